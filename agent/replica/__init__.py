"""The payload: a Llama-family model with the KV cache passed in, its engine, AOT build, golden check, worker and zygote."""

# KV-cache shape a build and a zygote default to (slots, tokens per slot).  Here, not in
# agent/replica/aot.py, so the command line's help does not import torch.
DEFAULT_MAX_SEQS = 8
DEFAULT_MAX_SEQ_LEN = 512
