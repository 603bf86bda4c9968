"""The soak (benchmarks/soak.py) as a benchmark-marked test, outside the default run: 2,000 optimizer steps of the
tiny model with RSS, CPU time per step and open files flat.

    python -m pytest benchmarks/test_soak.py -m benchmark -s
"""

import pytest
import soak


@pytest.mark.benchmark
def test_2000_steps_leave_rss_time_per_step_and_open_files_flat(tmp_path):
    result = soak.soak(2000, str(tmp_path / "run"))
    assert soak.check(result) == [], result["problems"] if "problems" in result else soak.check(result)
