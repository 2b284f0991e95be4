"""The notes' figures: every image a README embeds exists, every figure tools/figures.py draws is
embedded, and the script redraws each committed PNG (one process, no group, a few seconds)."""

import importlib.util
import re
from pathlib import Path

import pytest
from matplotlib.testing.compare import compare_images
from PIL import Image

from day20_pp import schedules

ROOT = Path(__file__).resolve().parent.parent
NOTES = [ROOT / "README.md", *sorted(ROOT.glob("day*/README.md"))]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
# compare_images' tolerance, the RMS of the pixel difference (0-255 per channel): the same
# matplotlib and FreeType redraw these files to 0.0 here; 1.0 leaves room for another machine's
# floating point in the rasteriser, while the smallest planted change tried (two of 1F1B's actions
# swapped on one rank) measures 8 and a whole schedule replaced 26. Across renderers no tolerance
# works: matplotlib 3.10 (FreeType 2.6.1) against 3.11 (FreeType 2.14) differs by 27-47 on these
# files, more than a planted change, because every glyph's edge and tight_layout's spacing move.
# So pixels are compared only under the renderer that drew the files (their Software tag).
TOL = 1.0


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "tools" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _figures()


def _embedded() -> dict[Path, Path]:
    """Every image link of the notes, resolved -> the README that links it."""
    return {
        (note.parent / link).resolve(): note
        for note in NOTES
        for link in IMAGE.findall(note.read_text())
        if "://" not in link
    }


def test_every_image_the_notes_embed_exists():
    missing = [f"{n.relative_to(ROOT)}: {p}" for p, n in _embedded().items() if not p.is_file()]
    assert not missing, missing


def test_every_figure_is_embedded_in_its_days_notes():
    embedded = _embedded()
    lost = [
        name
        for name, fig in figures.FIGURES.items()
        if embedded.get(ROOT / fig.path) != ROOT / Path(fig.path).parts[0] / "README.md"
    ]
    assert not lost, f"drawn by tools/figures.py but not embedded in its day's README: {lost}"


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_the_script_redraws_the_committed_figure(name, tmp_path):
    committed = ROOT / figures.FIGURES[name].path
    redrawn = Path(figures.write(name, str(tmp_path)))  # drawing errors fail under any renderer
    regenerate = f"run `python tools/figures.py --only {name}` and commit the PNG"
    size = Image.open(committed).size, Image.open(redrawn).size
    assert size[0] == size[1], (
        f"{committed.name}: {size[0]} px committed, {size[1]} now: {regenerate}"
    )
    drawn_with = Image.open(committed).text.get("Software", "")
    if figures.renderer() not in drawn_with:
        pytest.skip(
            f"{committed.name} was drawn by {drawn_with or 'an unknown renderer'}, this is "
            f"{figures.renderer()}: text renders differently, pixels are not comparable "
            f"(to compare here, {regenerate})"
        )
    diff = compare_images(str(committed), str(redrawn), tol=TOL)
    assert diff is None, (
        f"{committed.name} is not what tools/figures.py draws now: {diff}. "
        f"If the change is meant, {regenerate}."
    )


def test_a_changed_schedule_changes_the_figure(tmp_path, monkeypatch):
    """The comparison is not blind at TOL (under any renderer: both drawings made here): 1F1B's
    lists replaced by GPipe's turn it red."""
    before = figures.write("schedules", str(tmp_path / "before"))
    monkeypatch.setitem(schedules.SCHEDULES, "1f1b", schedules.SCHEDULES["gpipe"])
    after = figures.write("schedules", str(tmp_path / "after"))
    assert compare_images(before, after, tol=TOL) is not None
