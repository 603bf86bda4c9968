"""The training data: one record of a file as an example (`rows`), the instruction data from files or the
arithmetic generator, rendered with the model's chat template, tokenised and batched (`instructions`), and the
built-in identity task with its shipped `assets/` (`tasks`)."""
