"""The base model: where it comes from (`sources`), loading it, quantised or not (`load`), the adapters and the
optimizer's param groups (`adapters`), and the tiny scratch Llama with its byte tokenizer (`tiny`)."""
