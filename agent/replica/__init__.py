"""The payload: a Llama-family model with the KV cache passed in, its engine, AOT build, golden check, worker and zygote."""
