"""curves.png: the evaluation note hides no curve, and any output-folder name draws (or is left out) without
a matplotlib warning."""

import json
import warnings

import matplotlib

matplotlib.use("Agg")

from fused_stable.train.run import report  # noqa: E402

NOTE = "held-out evaluation, greedy    before        after\nidentity (answers 'Aster')     0.00 (0/12)   1.00"


def rows(n=30):
    return [{"step": s, "loss": 3.0 / s, "grad_norm": 1.0 + s, "lr": 1e-3, "skipped": s == 5} for s in range(1, n + 1)]


def test_the_note_covers_no_curve():
    import matplotlib.pyplot as plt

    fig = report.curves_figure(rows(), [], 1.0, NOTE, "run")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    note = next(t for ax in fig.axes for t in ax.texts if t.get_text() == NOTE)
    box = note.get_window_extent(renderer)
    for ax in fig.axes[:3]:  # loss, grad norm, lr
        assert not box.overlaps(ax.get_window_extent(renderer)), "the note is drawn over a curve panel"
    plt.close(fig)


def test_a_unicode_folder_name_draws_without_warnings(tmp_path):
    for name in ("训练-运行", "run-é"):
        out = tmp_path / name
        out.mkdir()
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # matplotlib's "Glyph ... missing from font" is a UserWarning
            path = report.plot_curves(str(out), 1.0, NOTE)
        assert (out / "curves.png").stat().st_size > 0 and path == str(out / "curves.png")
    assert report.drawable("run-é") and not report.drawable("训练")
