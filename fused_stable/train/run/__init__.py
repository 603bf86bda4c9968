"""One run of `fused-stable sft`: the command (`sft`), the loop (`loop`), where it runs (`runtime`; torchrun ranks
`parallel`; DeepSpeed `deepspeed_run`), what it owns in its folder and the folder's lock (`outputs`), what it
shows and leaves (`report`), how an early stop is said (`stop_message`), and its checkpoints: the folder protocol
(`checkpoint`) and what goes in and comes back for each kind of run (`checkpoint_contents`)."""
