"""A budget that follows the data by content (issue 39, item 1).

The same drawings read from the npz, the official zips, unpacked PNG folders, or a folder of
per-class PNGs run as ``image_folder``, and a subset of them, are charged to one budget: after a
run that spent the whole budget, each of them is refused, while drawings that share nothing with
it are new data. Older ledgers keyed by the data set's name keep their spends.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tests.federation.item_budget import BUDGET, DELTA, EVENT, budget_config, registered, spend_all
from tests.omniglot_files import png, write_release

import fedmeta.metalearning as ml
from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    DataItems,
    Participant,
    epsilon,
    resolve_federation,
)
from fedmeta.config_io import load_config
from fedmeta.server.budget_keys import CONTENT_LABEL
from fedmeta.server.startup import open_budget
from fedmeta.server.transport import Registered


def _drawings(seed: int, chars: int = 16) -> np.ndarray:
    """White-True masks [chars, 20, 105, 105], the npz convention."""
    return np.random.default_rng(seed).random((chars, 20, 105, 105)) > 0.1


def _official(root: Path, white: np.ndarray, layout: str) -> Path:
    """The drawings as Omniglot's npz, zips or unpacked folders (half background, half eval)."""
    root.mkdir(parents=True)
    half = len(white) // 2
    for part, first, block in (("images_background", 1, white[:half]),
                               ("images_evaluation", 965, white[half:])):  # fmt: skip
        if layout == "npz":
            np.savez(root / f"{part}.npz", images=block)
            continue
        files = {f"{part}/Alpha/character{c + 1:02d}/{first + c:04d}_{d + 1:02d}.png":
                 png(block[c, d]) for c in range(len(block)) for d in range(20)}  # fmt: skip
        write_release(root, part, files, as_zip=layout == "zip")
    return root


def _class_folders(root: Path, white: np.ndarray) -> Path:
    """The drawings as one folder of RGB PNGs per class (another loader, another format)."""
    for c in range(len(white)):
        (root / f"class{c:02d}").mkdir(parents=True)
        for d in range(20):
            (root / f"class{c:02d}" / f"{d}.png").write_bytes(png(white[c, d], "RGB"))
    return root


@pytest.mark.unit
def test_a_drawing_has_one_item_digest_in_every_layout(tmp_path: Path) -> None:
    white = _drawings(0, chars=4)
    ids = {layout: ml.omniglot_item_ids(_official(tmp_path / layout, white, layout), cache=False)
           for layout in ("npz", "zip", "folder")}  # fmt: skip
    assert len(np.unique(ids["npz"])) == 80
    assert np.array_equal(ids["npz"], ids["zip"]) and np.array_equal(ids["npz"], ids["folder"])
    folders = ml.load_image_folder(_class_folders(tmp_path / "cls", white), image_size=28)
    got = np.concatenate([s.item_ids for s in folders if s.item_ids is not None])
    assert set(got.tolist()) == set(ids["npz"].tolist())  # RGB PNGs of the masks: same items
    grey = Image.fromarray(np.where(white[0, 0], 200, 30).astype(np.uint8))  # not a drawing
    assert ml.image_item_digest(grey) != ml.image_item_digest(grey.convert("1"))


@pytest.mark.integration
@pytest.mark.parametrize("second", ["zip", "folder", "image_folder", "subset", "reshuffled"])
def test_the_same_drawings_through_another_loader_or_format_share_one_budget(
    tmp_path: Path, second: str
) -> None:
    db = tmp_path / "ledger.sqlite"
    white = _drawings(1)
    fid = spend_all(budget_config("omniglot", _official(tmp_path / "npz", white, "npz"), db))
    if second in ("zip", "folder"):
        cfg = budget_config("omniglot", _official(tmp_path / second, white, second), db)
    elif second == "image_folder":
        cfg = budget_config("image_folder", _class_folders(tmp_path / "cls", white), db)
    elif second == "subset":  # twelve of the sixteen characters, as image folders
        cfg = budget_config("image_folder", _class_folders(tmp_path / "cls", white[2:14]), db)
    else:  # the same characters in another order, so other partitions
        order = np.random.default_rng(5).permutation(len(white))
        cfg = budget_config("omniglot", _official(tmp_path / "perm", white[order], "npz"), db)
    with open_budget(cfg, registered(cfg)) as ledger:
        assert ledger.federation_id == fid and fid.startswith(f"{CONTENT_LABEL}-")
        assert ledger.would_exceed(EVENT), f"{second}: a fresh budget for recorded drawings"


@pytest.mark.integration
def test_drawings_that_share_nothing_are_new_data_and_a_superset_is_charged(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ledger.sqlite"
    white, other = _drawings(1), _drawings(2)
    spend_all(budget_config("omniglot", _official(tmp_path / "a", white, "npz"), db))
    fresh = budget_config("image_folder", _class_folders(tmp_path / "new", other), db)
    with open_budget(fresh, registered(fresh)) as ledger:
        assert ledger.rounds_affordable(EVENT) == 3  # its own budget: nothing overlaps
    both_path = _official(tmp_path / "both", np.concatenate([white, other]), "npz")
    both = budget_config("omniglot", both_path, db)
    with open_budget(both, registered(both)) as ledger:
        assert ledger.would_exceed(EVENT)  # a superset touches the spent records


@pytest.mark.unit
def test_a_ledger_keyed_by_the_data_sets_name_keeps_its_spends(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    old = resolve_federation(db, "omniglot", label="omniglot")
    people = [Participant(f"omniglot#participant={i}", str(i)) for i in range(2)]
    with BudgetLedger.open(db, old, BUDGET, DELTA, participants=people) as ledger:
        for i in range(3):
            ledger.spend(EVENT, "before-issue-39", i)
    cfg = budget_config("omniglot", _official(tmp_path / "npz", _drawings(3), "npz"), db)
    with open_budget(cfg, registered(cfg)) as ledger:
        assert ledger.federation_id != old
        assert ledger.would_exceed(EVENT)  # inherited, charged to every participant
        assert ledger.epsilon() == pytest.approx(epsilon([(EVENT, 3)], DELTA, "task"))


@pytest.mark.unit
def test_an_item_set_travels_as_text_and_back() -> None:
    items = DataItems.of([5, 3, 3, 2**64 - 1])
    assert len(items) == 3 and items.array().tolist() == [3, 5, 2**64 - 1]
    assert DataItems.from_text(items.to_text()) == items
    assert DataItems.from_text("omniglot:abc") is None
    with pytest.raises(ValueError, match="items-v2"):
        DataItems.from_text("items-v1:!!")


# ------------------------------------------------------------------ experiments: public data only


def _experiment(path: Path, tmp_path: Path) -> list[str]:
    return ["--set", "dataset.name=omniglot", "--set", f"dataset.path={path}",
            "--set", "dataset.ways=3", "--set", "dataset.shots=1", "--set", "dataset.query=1",
            "--set", "dataset.tasks_per_participant=5", "--set", "dataset.partition=even",
            "--set", "dataset.split=background", "--set", "federation.participants=2",
            "--set", "sampling.participants_per_round=1", "--set", "federation.backend=inprocess",
            "--set", "output.plots=false", "--set", "output.progress=false",
            "--experiment", "x", "--out", str(tmp_path / "out")]  # fmt: skip


@pytest.mark.integration
def test_an_experiment_on_drawings_of_no_public_release_is_refused_before_any_spend(
    tmp_path: Path, isolated_state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedmeta.cli import main

    path = _official(tmp_path / "npz", _drawings(4), "npz")
    capsys.readouterr()
    assert main(["simulate", *_experiment(path, tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--experiment x: 320 of the 320 items of dataset.path" in err
    assert "no known public release" in err and "run without --experiment" in err
    assert not (isolated_state_dir / "experiments").exists(), "a refused experiment made a ledger"


@pytest.mark.integration
def test_an_altered_omniglot_npz_is_refused_as_an_experiment(
    tmp_path: Path, shared_omniglot: Path
) -> None:
    from fedmeta.server.data_budget import NotPublicData, check_experiment_data

    with np.load(shared_omniglot / "images_background.npz") as z:
        background = z["images"][:8]
    with np.load(shared_omniglot / "images_evaluation.npz") as z:
        evaluation = z["images"][:8]
    for name, flip in (("public", False), ("mirrored", True)):
        root = tmp_path / name
        root.mkdir()
        for part, block in (("images_background", background), ("images_evaluation", evaluation)):
            np.savez(root / f"{part}.npz", images=block[..., ::-1] if flip else block)
        cfg = budget_config("omniglot", root, tmp_path / "l.sqlite").model_copy(deep=True)
        cfg = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(
            update={"experiment": "x", "ledger_path": None})})  # fmt: skip
        if flip:
            with pytest.raises(NotPublicData, match="320 of the 320 items"):
                check_experiment_data(cfg, [])
        else:
            check_experiment_data(cfg, [])  # a part of the release is public data


# ------------------------------------------------------------------ node keys name no budget


@pytest.mark.integration
@pytest.mark.parametrize("data", ["omniglot", "sinusoid"])
def test_enabling_node_keys_or_replacing_them_keeps_the_budget(tmp_path: Path, data: str) -> None:
    """Issue 39's scenario: 3 rounds without node authentication, 3 after turning it on, 3 after
    replacing every key. The budget affords 3: the second and third are refused at the budget."""
    db = tmp_path / "ledger.sqlite"
    if data == "omniglot":
        cfg = budget_config("omniglot", _official(tmp_path / "npz", _drawings(6), "npz"), db)
    else:
        cfg = load_config(None, [f"privacy.ledger_path={db}", f"privacy.delta={DELTA}",
                                 f"privacy.epsilon_budget={BUDGET!r}"])  # fmt: skip
    plain = registered(cfg) if data == "omniglot" else [
        Registered(str(i), 100 + i, 10, f"sinusoid:{i}") for i in range(2)]  # fmt: skip
    with open_budget(cfg, plain) as ledger:
        for i in range(3):
            ledger.spend(EVENT, "no-node-auth", i)
        fid = ledger.federation_id
    for key in ("first", "replaced"):
        keyed = [Registered(r.participant_id, r.node_id + 7, r.task_count,
                            r.data_fingerprint, node_key=f"SHA256:{key}-{r.participant_id}")
                 for r in plain]  # fmt: skip
        with open_budget(cfg, keyed) as ledger:
            assert ledger.federation_id == fid
            assert ledger.would_exceed(EVENT), f"node keys ({key}) opened a fresh budget"
            with pytest.raises(BudgetExhausted):
                ledger.spend(EVENT, f"node-keys-{key}", 0)
            assert ledger.position() == 3


# ------------------------------------------------------------------ one ledger per data; witness


@pytest.mark.integration
def test_a_second_ledger_path_for_recorded_data_is_refused_naming_the_first(
    tmp_path: Path,
) -> None:
    from fedmeta.server.ledger_witness import LedgerElsewhere

    path = _official(tmp_path / "npz", _drawings(7), "npz")
    first, second = tmp_path / "a" / "ledger.sqlite", tmp_path / "b" / "ledger.sqlite"
    first.parent.mkdir()
    spend_all(budget_config("omniglot", path, first))
    cfg = budget_config("omniglot", path, second)
    with pytest.raises(LedgerElsewhere) as refused:
        open_budget(cfg, registered(cfg))
    message = str(refused.value)
    assert "\n" not in message and f"recorded in ledger {first}" in message
    assert f"fedmeta ledger backup --db {first} --to {second}" in message
    assert not second.exists() and not second.parent.exists(), "a refused run created a ledger"
    other = budget_config("omniglot", _official(tmp_path / "other", _drawings(8), "npz"), second)
    open_budget(other, registered(other)).close()  # other data: a ledger of its own is fine


@pytest.mark.integration
def test_a_restored_state_directory_is_caught_by_the_witness_outside_it(
    tmp_path: Path, isolated_state_dir: Path
) -> None:
    import shutil

    from fedmeta.accounting import LedgerRolledBack, accept_rollback
    from fedmeta.server.ledger_witness import witness_file

    path = _official(tmp_path / "npz", _drawings(9), "npz")
    db = isolated_state_dir / "ledger.sqlite"
    cfg = budget_config("omniglot", path, db)
    with open_budget(cfg, registered(cfg)) as ledger:
        ledger.spend(EVENT, "first", 0)
    backup = tmp_path / "state-backup"
    shutil.copytree(isolated_state_dir, backup)  # the whole state directory, anchor included
    with open_budget(cfg, registered(cfg)) as ledger:
        ledger.spend(EVENT, "second", 0)
        ledger.spend(EVENT, "second", 1)
        assert ledger.anchor() is not None and ledger.anchor()["spends"] == 3  # type: ignore[index]
    shutil.rmtree(isolated_state_dir)
    shutil.copytree(backup, isolated_state_dir)  # restored: one spend, its own anchor agrees
    assert witness_file(db).is_file() and not witness_file(db).is_relative_to(isolated_state_dir)
    with pytest.raises(LedgerRolledBack) as refused:
        open_budget(cfg, registered(cfg))
    message = str(refused.value)
    assert "\n" not in message and "behind its witness" in message
    assert "an older copy was restored" in message and "accept-rollback --db" in message
    ledger_id = message.split("--ledger-id ")[1].split()[0]
    head = message.split("--head ")[1].split()[0]
    accept_rollback(db, "restored on purpose", ledger_id=ledger_id, head=head)
    with open_budget(cfg, registered(cfg)) as ledger:  # accepted on record: goes on
        assert ledger.position() == 1
