"""Imported last by the suite's forkserver (ranks.FORKSERVER_PRELOAD): moves every object the
preloaded imports made into the garbage collector's permanent generation (`gc.freeze()`).

A forked rank shares the server's memory copy-on-write. Without this, the rank's first full
collection (Engine.close() makes one; so does any gc.collect()) walks the ~400,000 objects
torch, dynamo and transformers left on the heap and writes to each one's header, copying every
page that holds one: ~25,000 page faults and ~0.25 s of CPU per rank. Frozen, they are never
walked: a 2-rank engine build-train-close went from 0.33 to 0.065 s of CPU per rank.
"""

import gc

gc.collect()
gc.freeze()
