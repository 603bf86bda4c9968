"""The thin trainer behind `fused-stable sft | chat | export`, in rooms named for their jobs (docs/design.md,
"Module map", lists every module):

- `config/`: the keys (defaults, ranges, help), reading YAML and flags with every check, other trainers' configs;
- `data/`: one dataset record as an example, the instruction data (files, chat template, tokens, batch order),
  the built-in identity task and its shipped assets;
- `model/`: where a base model comes from, loading it (quantised or not), the adapters, the tiny scratch model;
- `run/`: the sft command, the loop, where it runs (device, threads, torchrun ranks, DeepSpeed), the run folder
  and its lock, what it reports, how a stop is said, and checkpoints (the folder protocol and what goes in);
- `evaluation/`: greedy answers, the before/after evaluation, the held-out losses, a run's evaluations;
- `saved/`: the final adapter or model and loading it back, `chat` and `export`.
"""
