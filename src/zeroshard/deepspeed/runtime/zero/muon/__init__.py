"""`deepspeed.runtime.zero.muon`: DeepSpeed's Muon classes over zeroshard's Muon (optim/muon.py)."""
