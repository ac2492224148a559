"""TuningReport.plot(): per-target eager vs tuned bars and the end-to-end panel, on hand-made and real reports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("matplotlib", reason="TuningReport.plot() needs matplotlib (pip install aitune-hf[notebooks])")

from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from aitune_hf import TuningReport, register
from tests.core.modules import ManyOpsBlock, MLPBlock

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _signature(eager: float | None, chosen: str = "eager", tuned: float | None = None, signature: str = "x: f32[2, 8]",
               **extra: object) -> dict:  # fmt: skip
    candidates = [] if tuned is None else [{"backend": "onnxruntime", "latency_s": tuned, "max_abs_error": 1e-6}]
    return {"signature": signature, "samples": 1, "chosen": chosen, "eager_latency_s": eager,
            "candidates": candidates, **extra}  # fmt: skip


def _report_dict(end_to_end: bool = True) -> dict:
    """Four targets: tuned (2x), eager kept, still recording (no timings), one tuned for batch 1 and eager for batch
    32 (as a sentence-transformers encoder layer ends up under mixed traffic)."""
    return {
        "end_to_end": {"eager_s": 0.9, "tuned_s": 0.6, "speedup": 1.5, "method": "interleaved whole calls, 3 rounds"}
        if end_to_end
        else None,
        "tuning_seconds": 12.5,
        "modules": {
            "unet.down_blocks.0": {"name": "unet.down_blocks.0", "module_class": "CrossAttnDownBlock2D",
                                   "state": "tuned", "signatures": [_signature(0.004, "onnxruntime", 0.002)]},
            "unet.mid_block": {"name": "unet.mid_block", "module_class": "UNetMidBlock2DCrossAttn", "state": "eager",
                               "reason": "nothing was faster: best onnxruntime at 0.98x (needs 1.05x)",
                               "signatures": [_signature(0.003, "eager", 0.00306)]},
            "unet.up_blocks.0": {"name": "unet.up_blocks.0", "module_class": "UpBlock2D", "state": "recording",
                                 "signatures": []},
            "text_encoder.encoder.layers.0": {
                "name": "text_encoder.encoder.layers.0", "module_class": "CLIPEncoderLayer", "state": "tuned",
                "signatures": [_signature(0.0001, "onnxruntime", 5e-5, "float32[1x7x32]@cpu, float32[1x1x1x7]@cpu"),
                               _signature(0.0015, "eager", 0.00145, "float32[32x7x32]@cpu, float32[32x1x1x7]@cpu",
                                          reason="nothing was faster: best onnxruntime at 1.03x (needs 1.05x)")]},
        },
    }  # fmt: skip


def _bars(ax) -> dict[str, BarContainer]:
    return {c.get_label(): c for c in ax.containers if isinstance(c, BarContainer)}


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_hand_made_report_draws_one_bar_pair_per_timed_target(tmp_path) -> None:
    report = TuningReport.from_dict(_report_dict())
    fig = report.plot()
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    targets_ax, e2e_ax = fig.axes

    layer = "text_encoder.encoder.layers.0"  # a bar pair per input signature: each has its own story
    timed = [  # a label longer than 40 characters puts the signature on a line of its own
        "unet.down_blocks.0",
        "unet.mid_block",
        f"{layer}\n· float32[1x7x32]@cpu",
        f"{layer}\n· float32[32x7x32]@cpu",
    ]
    bars = _bars(targets_ax)
    assert set(bars) == {"eager", "tuned"}
    assert len(bars["eager"]) == len(bars["tuned"]) == len(timed)
    assert [label.get_text() for label in targets_ax.get_yticklabels()] == timed
    eager_ms = [bar.get_width() for bar in bars["eager"]]
    tuned_ms = [bar.get_width() for bar in bars["tuned"]]
    assert eager_ms == pytest.approx([4.0, 3.0, 0.1, 1.5]) and tuned_ms == pytest.approx([2.0, 3.0, 0.05, 1.5])

    notes = _texts(targets_ax)
    assert notes.count("2.00x  onnxruntime") == 2
    assert notes[3].startswith("EAGER kept: nothing was faster: best onnxruntime at 1.03x"), notes
    assert "1 target(s) without timings not shown" in targets_ax.get_xlabel()
    assert "block latency" in targets_ax.get_xlabel()
    assert [t.get_text() for t in targets_ax.get_legend().get_texts()][-1] == "EAGER kept"
    assert fig.get_suptitle().startswith("aitune_hf: 4 targets (eager 1, recording 1, tuned 2); tuning 12.5 s")

    assert e2e_ax.get_title() == "end to end: 1.50x"
    e2e = _bars(e2e_ax)["end to end"]
    assert [bar.get_height() for bar in e2e] == pytest.approx([900.0, 600.0])
    assert [t.get_text() for t in e2e_ax.get_xticklabels()] == ["eager", "tuned"]
    assert "interleaved whole calls" in e2e_ax.get_xlabel()

    assert fig._repr_png_().startswith(PNG_MAGIC)  # Jupyter shows it even without %matplotlib inline
    path = tmp_path / "report.png"
    fig.savefig(path, dpi=80)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_end_to_end_not_measured_and_linear_scale(tmp_path) -> None:
    fig = TuningReport.from_dict(_report_dict(end_to_end=False)).plot(log_scale=False, title="custom title")
    targets_ax, e2e_ax = fig.axes
    assert targets_ax.get_xscale() == "linear"
    assert any("not measured" in text for text in _texts(e2e_ax))
    assert not _bars(e2e_ax)
    assert fig.get_suptitle() == "custom title"
    fig.savefig(tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes().startswith(PNG_MAGIC)


def test_descended_targets_are_named() -> None:
    data = _report_dict()
    data["descended"] = {"vae.decoder": {"name": "vae.decoder", "module_class": "Decoder", "state": "eager",
                                         "reason": "nothing was faster", "signatures": []}}  # fmt: skip
    fig = TuningReport.from_dict(data).plot()
    assert "descended into the blocks of: vae.decoder" in fig.axes[0].get_xlabel()
    assert len(_bars(fig.axes[0])["eager"]) == 4


def test_log_scale_when_latencies_span_decades() -> None:
    fig = TuningReport.from_dict(_report_dict()).plot()  # 0.1 ms .. 4 ms: 40x apart
    assert fig.axes[0].get_xscale() == "log"
    assert "log scale" in fig.axes[0].get_xlabel()


def test_draws_into_given_axes() -> None:
    fig = Figure()
    pair = fig.subplots(1, 2)
    report = TuningReport.from_dict(_report_dict())
    assert report.plot(ax=pair) is fig
    assert len(_bars(pair[0])["tuned"]) == 4 and len(_bars(pair[1])["end to end"]) == 2

    single = Figure().subplots()
    assert report.plot(ax=single) is single.figure
    assert len(_bars(single)["eager"]) == 4 and len(single.figure.axes) == 1
    assert fig.get_suptitle() == single.figure.get_suptitle() == ""  # the caller's figures keep their titles
    report.plot(ax=pair, title="mine")
    assert fig.get_suptitle() == "mine"

    with pytest.raises(TypeError, match="pair"):
        report.plot(ax=[single])


def test_table_and_html_tell_each_signature_apart(tmp_path) -> None:
    """A target tuned for one batch size and eager for another shows both, the eager one with its reason: in the
    table, the HTML (which embeds the figure) and the plot (above)."""
    report = TuningReport.from_dict(_report_dict())
    text = str(report)
    layer_row = next(line for line in text.splitlines() if line.startswith("text_encoder.encoder.layers.0"))
    assert "eager+onnxruntime" in layer_row
    below = text.splitlines()[text.splitlines().index(layer_row) + 1 :][:2]
    assert below[0].startswith("  · float32[1x7x32]@cpu") and "tuned" in below[0] and "2.00x" in below[0]
    assert below[1].startswith("  · float32[32x7x32]@cpu") and "eager" in below[1]
    assert below[1].endswith("nothing was faster: best onnxruntime at 1.03x (needs 1.05x)")
    assert not any(line.startswith("  · x: f32") for line in text.splitlines())  # one signature: no sub-rows

    page = report.to_html(tmp_path / "report.html")
    assert page.count("<img alt='eager vs tuned latency per target' src='data:image/png;base64,") == 1
    assert "nothing was faster: best onnxruntime at 1.03x (needs 1.05x)" in page
    assert "float32[32x7x32]@cpu" in page
    assert (tmp_path / "report.html").read_text().startswith("<!doctype html>")
    assert report._repr_html_() == report.to_html()
    assert "<img" not in report.to_html(figure=False)


def test_no_timings_yet() -> None:
    data = _report_dict()
    data["modules"] = {"unet.up_blocks.0": data["modules"]["unet.up_blocks.0"]}
    fig = TuningReport.from_dict(data).plot()
    assert not _bars(fig.axes[0])
    assert "no target has timings yet" in _texts(fig.axes[0])


def test_report_of_a_real_tuning_run(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(ManyOpsBlock(), torch.nn.Linear(16, 32), MLPBlock(32), MLPBlock(32)).eval()
    blocks = {"many_ops": model[0], "mlp.0": model[2], "mlp.1": model[3]}
    registration = register(blocks, {"backends": ["onnxruntime"], "progress": False, "warmup": 1, "repeats": 3})
    x = torch.randn(4, 16)
    with torch.inference_mode():
        model(x)  # recording
        registration.tune()
        model(x)  # tuning
        model(x)  # tuned
    assert registration.all_tuned
    report = registration.report()
    timed = [n for n, m in report.modules.items() if m.eager_latency_s is not None and m.tuned_latency_s is not None]
    assert timed == list(blocks)

    fig = report.plot()
    targets_ax, e2e_ax = fig.axes
    bars = _bars(targets_ax)
    assert len(bars["eager"]) == len(bars["tuned"]) == len(timed)
    assert [label.get_text() for label in targets_ax.get_yticklabels()] == timed
    for name, bar in zip(timed, bars["tuned"], strict=True):
        assert bar.get_width() == pytest.approx(report.modules[name].tuned_latency_s * 1e3)
    assert len(_texts(targets_ax)) == len(timed)  # one annotation per target
    assert any("not measured" in text for text in _texts(e2e_ax))  # the core alone times no whole calls
    assert fig.get_suptitle().startswith("aitune_hf: 3 targets")
    path = tmp_path / "real.png"
    fig.savefig(path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    registration.detach()


def test_no_pyplot_no_global_backend() -> None:
    """Importing needs no matplotlib; plotting uses a bare Figure, never pyplot nor a backend switch."""
    code = (
        "import sys, io\n"
        "import aitune_hf, aitune_hf.plotting\n"
        "assert 'matplotlib' not in sys.modules, 'imported matplotlib eagerly'\n"
        "report = aitune_hf.TuningReport.from_dict({'modules': {}})\n"
        "buffer = io.BytesIO()\n"
        "report.plot().savefig(buffer, format='png')\n"
        "assert buffer.getvalue().startswith(b'\\x89PNG')\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'imported pyplot (which picks a backend)'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def _long_names_report(count: int) -> TuningReport:
    """Blocks with long dotted names, half of them met at two batch sizes, chosen backends with long options."""
    bf16, int8 = "inductor(freezing=True, precision=bf16)", "onnxruntime(precision=int8)"
    modules = {}
    for i in range(count):
        name = f"transformer.single_transformer_blocks.{i}.attn.to_out.very_long_projection_name.lora_A.default"
        signatures = [_signature(0.004, bf16, 0.002, "float32[1x4096x3072]@cpu, float32[1x1x4096]@cpu")]
        if i % 2:
            signatures.append(_signature(0.008, int8, 0.003, "float32[32x4096x3072]@cpu"))
        for signature in signatures:
            signature["candidates"][0]["backend"] = signature["chosen"]
        modules[name] = {"name": name, "module_class": "FluxSingleTransformerBlock", "state": "tuned",
                         "signatures": signatures}  # fmt: skip
    end_to_end = {"eager_s": 0.9, "tuned_s": 0.6, "speedup": 1.5, "method": "whole calls of the same inputs"}
    return TuningReport.from_dict({"modules": modules, "tuning_seconds": 3.0, "end_to_end": end_to_end})


@pytest.mark.parametrize("count", [2, 12])
def test_long_block_names_fit_the_figure_and_notes_their_panel(count: int) -> None:
    """Rendered with Agg: every tick label lies inside the figure, wrapped at its dots (no word cut), every
    annotation inside the per-target panel, and the figure grows with the number of blocks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    report = _long_names_report(count)
    fig = report.plot()
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    targets_ax, e2e_ax = fig.axes
    labels = targets_ax.get_yticklabels()
    assert len(labels) == count + count // 2
    for label in labels:
        box = label.get_window_extent(renderer)
        assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1, (label.get_text(), box, figure_box)
        assert figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1, (label.get_text(), box, figure_box)
        assert all(len(line) <= 40 for line in label.get_text().splitlines())
        assert label.get_text().split("\n")[0].startswith("transformer.single_transformer_blocks.")  # cut at dots
    panel = targets_ax.get_window_extent(renderer)
    assert panel.width >= 0.35 * figure_box.width  # labels and notes did not squeeze the bars to a sliver
    for note in targets_ax.texts:
        box = note.get_window_extent(renderer)
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1, (note.get_text(), box, panel)
    backends = {note.get_text().split("  ")[1] for note in targets_ax.texts}  # long ones abbreviated as in the table
    assert backends == {"inductor(freezing, bf16)", "onnxruntime(precision=int8)"}
    title = e2e_ax.title.get_window_extent(renderer)
    assert figure_box.x0 <= title.x0 and title.x1 <= figure_box.x1
    assert fig.get_size_inches()[1] >= 0.7 * len(labels)  # about two lines of labels a bar pair
