"""What a run saved: the final adapter or model, found, checked and loaded back on its base (`final_model`),
and the commands over it, `chat` and `export`."""
