"""Identity = what the model sees (issue 52, items 2, 3 and 8).

Omniglot-format data is made here: drawings of random pen strokes, black on white, 105 x 105, as
the official release's. After a run spends the whole budget on them, each copy the issue lists is
refused as the same data: JPEG q95 copies, copies resized to 28 x 28 before loading, a 1-pixel
border crop, and the same grey-level files through the other loader; drawings that share nothing
are still new data. A split that turns recorded participants' items into validation or test items
is refused. And the ledger keeps looks only sealed, and gives records from before looks the looks
of their items when these come again.
"""

from __future__ import annotations

import io
import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw
from tests.federation.item_budget import BUDGET, DELTA, EVENT, budget_config, registered, spend_all

from fedmeta.accounting import BudgetLedger, DataItems
from fedmeta.accounting import Participant as LedgerParticipant
from fedmeta.metalearning import load_image_folder
from fedmeta.server.startup import open_budget
from fedmeta.workload import build_workload

CHARS, DRAWINGS = 16, 20


def strokes(seed: int, n: int, *, width: int = 4, antialias: bool = False) -> list[Image.Image]:
    """``n`` drawings of three to five random pen strokes, black ink on white paper (mode L).

    ``antialias``: drawn at four times the size and reduced, so the strokes' edges are grey.
    """
    rng = np.random.default_rng(seed)
    scale = 4 if antialias else 1
    out = []
    for _ in range(n):
        image = Image.new("L", (105 * scale, 105 * scale), 255)
        pen = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(3, 6))):
            points = [tuple(int(v) for v in rng.integers(15, 90, 2) * scale) for _ in range(3)]
            pen.line(points, fill=0, width=width * scale)
        out.append(image.resize((105, 105), Image.Resampling.LANCZOS) if antialias else image)
    return out


def encoded(image: Image.Image, fmt: str = "PNG", **kw: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def omniglot_folders(root: Path, drawings: list[Image.Image]) -> Path:
    """The drawings as Omniglot's unpacked folders (half background, half evaluation)."""
    half = CHARS // 2
    for c in range(CHARS):
        part, first = ("images_background", 1) if c < half else ("images_evaluation", 965 - half)
        folder = root / part / "Alpha" / f"character{c + 1:02d}"
        folder.mkdir(parents=True)
        for d in range(DRAWINGS):
            (folder / f"{first + c:04d}_{d + 1:02d}.png").write_bytes(
                encoded(drawings[c * DRAWINGS + d]))  # fmt: skip
    return root


def class_folders(root: Path, files: list[bytes], suffix: str) -> Path:
    """The drawings as one folder per character (``image_folder``), in the given encoding."""
    for c in range(CHARS):
        (root / f"class{c:02d}").mkdir(parents=True)
        for d in range(DRAWINGS):
            (root / f"class{c:02d}" / f"{d:02d}{suffix}").write_bytes(files[c * DRAWINGS + d])
    return root


Copy = Callable[[list[Image.Image], Path], tuple[str, Path]]
COPIES: dict[str, Copy] = {
    "JPEG q95, image folder": lambda ds, root: ("image_folder", class_folders(
        root, [encoded(d, "JPEG", quality=95) for d in ds], ".jpg")),
    "JPEG q95 re-saved as PNG, Omniglot loader": lambda ds, root: ("omniglot", omniglot_folders(
        root, [Image.open(io.BytesIO(encoded(d, "JPEG", quality=95))) for d in ds])),
    "resized to 28x28 first, image folder": lambda ds, root: ("image_folder", class_folders(
        root, [encoded(d.resize((28, 28), Image.Resampling.LANCZOS)) for d in ds], ".png")),
    "1-pixel border crop, Omniglot loader": lambda ds, root: ("omniglot", omniglot_folders(
        root, [d.crop((1, 1, 104, 104)) for d in ds])),
}  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("copy", sorted(COPIES))
def test_a_lossy_resized_or_cropped_copy_is_the_recorded_data(tmp_path: Path, copy: str) -> None:
    """Issue 52, item 2: each copy was a fresh budget (its exact pixels differ)."""
    db = tmp_path / "ledger.sqlite"
    drawings = strokes(1, CHARS * DRAWINGS)
    spend_all(budget_config("omniglot", omniglot_folders(tmp_path / "original", drawings), db))
    name, path = COPIES[copy](drawings, tmp_path / "copy")
    cfg = budget_config(name, path, db)
    with open_budget(cfg, registered(cfg)) as ledger:
        assert ledger.would_exceed(EVENT), f"{copy}: a fresh budget for recorded drawings"


@pytest.mark.integration
def test_drawings_that_share_nothing_are_still_new_data(tmp_path: Path) -> None:
    """The control: the tolerance does not make every drawing a recorded one."""
    db = tmp_path / "ledger.sqlite"
    spend_all(budget_config("omniglot", omniglot_folders(tmp_path / "a", strokes(1, 320)), db))
    cfg = budget_config("omniglot", omniglot_folders(tmp_path / "b", strokes(2, 320)), db)
    with open_budget(cfg, registered(cfg)) as ledger:
        assert ledger.rounds_affordable(EVENT) == 3


@pytest.mark.integration
def test_grey_level_files_are_one_item_through_either_loader(tmp_path: Path) -> None:
    """Issue 52, item 3: the Omniglot loader thresholds grey levels, ``image_folder`` keeps them;
    the exact digests differ, so the same files were two budgets."""
    db = tmp_path / "ledger.sqlite"
    drawings = strokes(3, CHARS * DRAWINGS, antialias=True)
    assert len(np.unique(np.asarray(drawings[0]))) > 2  # grey levels, not a pure drawing
    spend_all(budget_config("omniglot", omniglot_folders(tmp_path / "omniglot", drawings), db))
    folder = class_folders(tmp_path / "folder", [encoded(d) for d in drawings], ".png")
    cfg = budget_config("image_folder", folder, db)
    with open_budget(cfg, registered(cfg)) as ledger:
        assert ledger.would_exceed(EVENT), "the same grey-level files: a second budget"


@pytest.mark.integration
def test_a_split_that_makes_participants_items_held_out_is_refused(tmp_path: Path) -> None:
    """Issue 52, item 8: under another seed, recorded participants' items became validation and
    test items, whose metrics are released without the accountant."""
    from fedmeta.server.data_budget import EvaluationDataPrivate, check_evaluation_data

    db = tmp_path / "ledger.sqlite"
    files = [encoded(d) for d in strokes(4, CHARS * DRAWINGS)]
    folder = class_folders(tmp_path / "cls", files, ".png")
    seed0 = budget_config("image_folder", folder, db, "seed=0", "dataset.split=dpmaml")
    spend_all(seed0)
    check_evaluation_data(seed0, build_workload(seed0), db)  # its own split: allowed
    seed7 = budget_config("image_folder", folder, db, "seed=7", "dataset.split=dpmaml")
    with pytest.raises(EvaluationDataPrivate, match=r"items are recorded as participants'") as e:
        check_evaluation_data(seed7, build_workload(seed7), db)
    assert "\n" not in str(e.value) and "seed" in str(e.value)
    diagnostics = budget_config("image_folder", folder, db, "seed=7", "dataset.split=dpmaml",
                                "metrics.private_diagnostics=true")  # fmt: skip
    check_evaluation_data(diagnostics, build_workload(diagnostics), db)  # private diagnostics


def _looks(seed: int, n: int) -> np.ndarray:
    from fedmeta.metalearning.items import model_input_looks

    return model_input_looks(np.stack([255 - np.asarray(d) for d in strokes(seed, n)])[:, None])


@pytest.mark.unit
def test_looks_are_stored_sealed_and_old_records_gain_them(tmp_path: Path) -> None:
    """No stored value is a look; a record from before looks (digests alone) keeps charging its
    items exactly, and once they come again with looks their near-duplicates are charged too."""
    from fedmeta.item_identity import LOOK_TOLERANCE

    db = tmp_path / "ledger.sqlite"
    looks = _looks(5, 40)
    digests = np.arange(1, 41, dtype=np.uint64)
    federation = "images-test"
    people = [LedgerParticipant("old", "0", items=DataItems.of(digests))]  # before looks
    with BudgetLedger.open(db, federation, BUDGET, DELTA, participants=people) as ledger:
        for i in range(3):
            ledger.spend(EVENT, "before-looks", i)
    again = [LedgerParticipant("again", "0", items=DataItems.of(digests, looks))]
    with BudgetLedger.open(db, federation, BUDGET, DELTA, participants=again) as ledger:
        assert ledger.would_exceed(EVENT)  # by digest
    near = looks.copy()
    near[:, 0] ^= 0b111  # three bits of each look changed: a near-duplicate, another digest
    assert LOOK_TOLERANCE >= 3
    copies = [LedgerParticipant("copy", "0", items=DataItems.of(digests + 1000, near))]
    with BudgetLedger.open(db, federation, BUDGET, DELTA, participants=copies) as ledger:
        assert ledger.would_exceed(EVENT)
    raw = db.read_bytes()
    assert all(look.tobytes() not in raw for look in looks)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM data_looks").fetchone()[0] >= len(looks)


@pytest.mark.unit
def test_every_loader_gives_a_drawing_the_same_look(tmp_path: Path) -> None:
    """The look is of the model's input: Omniglot's stroke intensity and an image folder's RGB of
    the same PNGs are one picture (paper made dark), within a few bits."""
    from fedmeta.item_identity import LOOK_TOLERANCE
    from fedmeta.metalearning import load_omniglot

    drawings = strokes(6, CHARS * DRAWINGS)
    omniglot = load_omniglot(omniglot_folders(tmp_path / "o", drawings), split="all", cache=False)
    folder = load_image_folder(
        class_folders(tmp_path / "f", [encoded(d) for d in drawings], ".png"),
        image_size=28, fractions=(1.0, 0.0, 0.0))  # fmt: skip
    a, b = omniglot.train.item_looks, folder.train.item_looks
    assert a is not None and b is not None and len(a) == len(b) == CHARS * DRAWINGS
    distance = np.unpackbits(a ^ b, axis=1).sum(axis=1)  # both in the drawings' order
    assert distance.max() <= LOOK_TOLERANCE // 4, distance.max()


@pytest.mark.unit
@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32)),
                min_size=1, max_size=30))  # fmt: skip
def test_an_item_set_travels_as_text_with_its_looks(rows: list[tuple[int, bytes]]) -> None:
    """Sent and read back, a set is the same rows (digest and look together), repeats once;
    a participant of an older fedmeta (``items-v1:``, digests alone) is still read."""
    digests = np.asarray([d for d, _ in rows], dtype=np.uint64)
    looks = np.frombuffer(b"".join(look for _, look in rows), dtype=np.uint8).reshape(-1, 32)
    items = DataItems.of(digests, looks)
    back = DataItems.from_text(items.to_text())
    assert back == items and len(items) == len(set(rows))
    assert items.array().tolist() == sorted({d for d, _ in rows})
    assert back is not None and back.look_array() is not None
    old = "items-v1:" + DataItems.of(digests).to_text().split(":")[1]
    v1 = DataItems.from_text(old)
    assert v1 is not None and v1.look_array() is None
    assert v1.array().tolist() == sorted(set(digests.tolist()))
