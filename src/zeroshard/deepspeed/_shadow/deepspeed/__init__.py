"""`import deepspeed`, served by zeroshard (zeroshard.deepspeed).

This folder is put on PYTHONPATH by `zeroshard launch` (and by `python -m
zeroshard.deepspeed.shadow`), never by installing zeroshard. Importing this package
replaces itself with `zeroshard.deepspeed` and makes every `deepspeed.X` the module
`zeroshard.deepspeed.X` (one module object under both names); a `deepspeed.X` zeroshard
does not serve fails with one error naming it. See docs/huggingface.md.
"""

from zeroshard.deepspeed.shadow import serve

serve()
