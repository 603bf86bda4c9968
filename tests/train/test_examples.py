"""examples/*.yaml: every shipped config loads through the trainer's own loader and trains, so none can rot.

Each file is run the way a user tries it on a small machine: `fused-stable sft --config examples/x.yaml
--model tiny --max_steps 2 --output_dir ...`, the three overrides on the command line and every other key
from the file.
"""

import json
from pathlib import Path

import pytest
import yaml
from sft_helpers import REPO_ROOT, read_metrics

from fused_stable.train.config import foreign_configs
from fused_stable.train.config.keys import FIELDS
from fused_stable.train.config.resolve import resolve_config, run_dict

EXAMPLES = Path(REPO_ROOT) / "examples"
CONFIGS = sorted(EXAMPLES.glob("*.yaml"))
# the recipes README.md and docs/trainer.md point to, and one config in each anchor's format (docs/trainer.md,
# "Coming from LLaMA-Factory / ms-swift")
DOCUMENTED = {"lora", "qlora", "full", "guard_rollback", "llamafactory_lora_sft", "ms_swift_lora_sft"}
# what the test changes on the command line, as a user trying an example on a small machine would
OVERRIDES = {"model": "tiny", "max_steps": 2}


def test_every_documented_example_is_there():
    assert DOCUMENTED <= {path.stem for path in CONFIGS}, f"examples/ holds {[p.name for p in CONFIGS]}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_loads_as_written_and_says_what_it_is_for(path):
    cfg, explicit = resolve_config(["--config", str(path)])
    keys = set(yaml.safe_load(path.read_text()))
    if foreign_configs.anchor_of(keys) is None:
        assert explicit == keys, "every key of the file is read as a key"
    else:  # written for LLaMA-Factory or ms-swift: every key is ours or one the mapping reads
        assert all(k in FIELDS or foreign_configs.known(k) for k in keys)
        assert explicit >= keys & set(FIELDS)
    assert path.read_text().startswith("# "), f"{path.name} starts with a comment saying what it is for"
    assert cfg.output_dir.startswith("runs/"), "an example writes under runs/, like the default run"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_trains_on_the_tiny_model(path, sft, tmp_path):
    out = tmp_path / "run"
    code, _, err = sft("--config", path, "--model", "tiny", "--max_steps", "2", "--output_dir", out)
    assert code == 0, err

    # the run is the file's recipe: every key as the file sets it, except the overrides
    expected = run_dict(resolve_config(["--config", str(path)])[0]) | OVERRIDES | {"output_dir": str(out)}
    assert yaml.safe_load((out / "run.yaml").read_text()) == expected
    assert read_metrics(out)[-1]["step"] == 2
    cfg = resolve_config(["--config", str(path)])[0]
    if cfg.tuner == "full":
        assert (out / "model" / "config.json").is_file()
    else:
        saved = json.loads((out / "adapter" / "fused_stable.json").read_text())
        assert (saved["tuner"], saved["quant_bits"]) == (cfg.tuner, cfg.quant_bits)
