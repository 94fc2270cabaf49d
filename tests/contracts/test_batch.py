"""The orchestrator -> trainer batch contract: packing invariants and the validated file format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from primejax.contracts.batch import (
    FIELDS,
    FORMAT_VERSION,
    MANIFEST_KEY,
    BatchFormatError,
    PackedBatch,
    TrainingSample,
    pack_samples,
    read_batch,
    step_dir,
    wait_for_batch,
    write_batch,
)


def make_sample(rng: np.random.Generator, n: int, prompt: int = 3, vocab: int = 100, **kw) -> TrainingSample:
    mask = [False] * prompt + [True] * (n - prompt)
    lps = [0.0] * prompt + list(-rng.random(n - prompt))
    return TrainingSample(
        token_ids=list(rng.integers(0, vocab, n)),
        loss_mask=mask,
        inference_logprobs=lps,
        advantages=[float(rng.normal())] * n,
        temperature=float(rng.uniform(0.5, 1.5)),
        **kw,
    )


def samples_of(batch: PackedBatch) -> list[tuple[int, ...]]:
    """Recover each sample's tokens from a packed batch via its segment ids."""
    out = []
    for r in range(batch.rows):
        for seg in range(1, batch.segment_ids[r].max() + 1):
            sel = batch.segment_ids[r] == seg
            out.append(tuple(batch.tokens[r, sel]))
    return out


@pytest.mark.parametrize("num_shards,multiple", [(1, 1), (2, 1), (3, 2)])
def test_packing_loses_and_duplicates_no_token(num_shards, multiple):
    rng = np.random.default_rng(0)
    samples = [make_sample(rng, int(n)) for n in rng.integers(4, 33, 40)]
    shards = pack_samples(samples, seq_len=32, num_shards=num_shards, pad_rows_to_multiple=multiple)
    assert len(shards) == num_shards
    assert len({b.rows for b in shards}) == 1 and shards[0].rows % multiple == 0
    packed = sorted(s for b in shards for s in samples_of(b))
    assert packed == sorted(tuple(s.token_ids) for s in samples)
    total_loss = sum(int(b.loss_mask.sum()) for b in shards)
    assert total_loss == sum(sum(s.loss_mask) for s in samples)
    for b in shards:
        assert b.tokens.shape[1] == 32
        real = b.segment_ids > 0
        # positions restart at 0 per segment and count up contiguously
        for r in range(b.rows):
            for seg in range(1, b.segment_ids[r].max() + 1):
                pos = b.positions[r, b.segment_ids[r] == seg]
                np.testing.assert_array_equal(pos, np.arange(len(pos)))
        assert not b.loss_mask[~real].any()


def test_packing_carries_streams_and_default_weights():
    rng = np.random.default_rng(1)
    plain = make_sample(rng, 10)
    weighted = make_sample(rng, 8, ce_weights=[0.5] * 8, ref_logprobs=[-1.0] * 8)
    (b,) = pack_samples([plain, weighted], seq_len=32)
    seg_plain = b.segment_ids[0] == 1  # longest first
    seg_w = b.segment_ids[0] == 2
    np.testing.assert_allclose(b.temperatures[0, seg_plain], plain.temperature, rtol=1e-6)
    # no stream shipped: rl weight 1 everywhere (gated by loss_mask in the loss), no ce / ref_kl
    assert (b.rl_weights[0, seg_plain] == 1).all() and (b.ce_weights[0, seg_plain] == 0).all()
    # some stream shipped: omitted ones are 0
    assert (b.rl_weights[0, seg_w] == 0).all() and (b.ce_weights[0, seg_w] == 0.5).all()
    assert (b.ref_logprobs[0, seg_w] == -1).all()
    assert b.meta["present_streams"] == ["advantages", "ce_weights", "ref_logprobs"]


def test_packing_rejects_or_truncates_long_samples():
    rng = np.random.default_rng(2)
    long = make_sample(rng, 40)
    with pytest.raises(BatchFormatError, match="exceeds seq_len"):
        pack_samples([long], seq_len=32)
    (b,) = pack_samples([long], seq_len=32, truncate=True)
    assert b.meta["num_truncated"] == 1 and (b.segment_ids[0] == 1).all()


def test_sample_validation_names_the_field():
    s = TrainingSample(token_ids=[1, 2, 3], loss_mask=[False, True], inference_logprobs=[0, 0, 0])
    with pytest.raises(BatchFormatError, match="loss_mask"):
        pack_samples([s], seq_len=8)
    s = TrainingSample(token_ids=[1, 2], loss_mask=[True, True], inference_logprobs=[0, 0])
    with pytest.raises(BatchFormatError, match="first token"):
        pack_samples([s], seq_len=8)


@pytest.fixture
def written(tmp_path):
    rng = np.random.default_rng(3)
    (b,) = pack_samples([make_sample(rng, int(n)) for n in (10, 20, 7)], seq_len=24)
    path = write_batch(step_dir(tmp_path, 5), 0, b, meta={"step": 5})
    return b, path


def test_write_read_roundtrip(written, tmp_path):
    b, path = written
    assert path == tmp_path / "rollouts" / "step_5" / "rank_0.npz"
    assert wait_for_batch(tmp_path, 5, 0, timeout_s=0) == path
    got = read_batch(path, vocab_size=100)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(b, name))
    assert got.meta["step"] == 5 and got.meta["num_samples"] == 3


def test_read_rejects_truncated_file(written):
    _, path = written
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BatchFormatError, match=r"rank_0\.npz.*'<file>'|rank_0\.npz.*field"):
        read_batch(path)


def _rewrite(path, mutate):
    with np.load(path, allow_pickle=False) as d:
        arrays = {k: d[k] for k in d.files}
    mutate(arrays)
    np.savez(path, **arrays)


def test_read_rejects_missing_field(written):
    _, path = written
    _rewrite(path, lambda a: a.pop("advantages"))
    with pytest.raises(BatchFormatError, match=r"rank_0\.npz: field 'advantages': missing"):
        read_batch(path)


def test_read_rejects_mismatched_lengths(written):
    _, path = written
    _rewrite(path, lambda a: a.update(positions=a["positions"][:, :-1]))
    with pytest.raises(BatchFormatError, match=r"rank_0\.npz: field 'positions': shape"):
        read_batch(path)


def test_read_rejects_corrupted_values_and_bad_tokens(written):
    _, path = written

    def corrupt(a):
        a["inference_logprobs"] = a["inference_logprobs"].copy()
        a["inference_logprobs"][0, 3] += 1.0

    _rewrite(path, corrupt)
    with pytest.raises(BatchFormatError, match="'inference_logprobs': sha256 mismatch"):
        read_batch(path)


def test_read_rejects_out_of_vocab_tokens(written):
    _, path = written
    with pytest.raises(BatchFormatError, match="'tokens': token id outside"):
        read_batch(path, vocab_size=5)


def test_wait_for_batch_times_out(tmp_path):
    with pytest.raises(TimeoutError, match="rank_1.npz"):
        wait_for_batch(tmp_path, 1, 1, timeout_s=0.0, poll_s=0.0)


def test_prune_rollouts_removes_each_ranks_file_then_the_step(tmp_path):
    """Each rank deletes its own files; the step directory goes with the last one; later steps and
    unfinished writes stay."""
    from primejax.contracts.batch import prune_rollouts

    for step in (1, 2, 3):
        for rank in (0, 1):
            write_batch(step_dir(tmp_path, step), rank, PackedBatch.empty(2, 8))
    (tmp_path / "rollouts" / ".step_4.abc.tmp").mkdir()
    assert prune_rollouts(tmp_path, 0, 2) == []  # rank 1's files keep steps 1 and 2
    assert (
        not (step_dir(tmp_path, 1) / "rank_0.npz").exists()
        and (step_dir(tmp_path, 1) / "rank_1.npz").exists()
    )
    assert prune_rollouts(tmp_path, 1, 2) == [1, 2]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [".step_4.abc.tmp", "step_3"]
    assert prune_rollouts(tmp_path / "nothing", 0, 9) == []


# What each batch format version holds (primejax/contracts/batch.py, "Format versions"): the arrays with their
# dtypes, the optional routed pair, and the meta keys pack_samples writes. Pinned here so that a change to
# the file's content without a FORMAT_VERSION bump fails; a new version gets a new entry, old ones stay.
_V1_ARRAYS = {
    "tokens": "<i4",
    "positions": "<i4",
    "segment_ids": "<i4",
    "loss_mask": "|b1",
    "inference_logprobs": "<f4",
    "advantages": "<f4",
    "temperatures": "<f4",
    "ref_logprobs": "<f4",
    "rl_weights": "<f4",
    "ce_weights": "<f4",
    "ref_kl_weights": "<f4",
}
_V1_META = {
    "shard",
    "num_shards",
    "num_samples",
    "num_tokens",
    "num_loss_tokens",
    "num_truncated",
    "max_segments",
    "min_policy_version",
    "max_policy_version",
    "present_streams",
}
FORMATS = {
    1: {"arrays": _V1_ARRAYS, "routed": {"routed_experts": "|u1", "routed_mask": "|b1"}, "meta": _V1_META},
    2: {
        "arrays": {**_V1_ARRAYS, "env_ids": "<i4", "staleness": "<i4"},
        "routed": {"routed_experts": "|u1", "routed_mask": "|b1"},
        "meta": _V1_META | {"envs"},
    },
}


def _manifest(path) -> dict:
    with np.load(path, allow_pickle=False) as d:
        return json.loads(d[MANIFEST_KEY].tobytes().decode("utf-8"))


def test_the_format_version_names_what_a_file_holds(tmp_path):
    """The arrays, the routed pair and the meta keys of a written file are those pinned for FORMAT_VERSION."""
    assert FORMAT_VERSION == max(FORMATS), "a new format version needs its entry in FORMATS"
    want = FORMATS[FORMAT_VERSION]
    rng = np.random.default_rng(0)
    plain = pack_samples([make_sample(rng, 9), make_sample(rng, 6)], seq_len=16, step=3, envs=["a"])[0]
    routed = pack_samples(
        [
            make_sample(
                rng,
                8,
                routed_experts=np.tile(np.arange(2, dtype=np.uint8), (8, 2, 1)),
                routed_mask=[False] + [True] * 7,
            )
        ],
        seq_len=16,
    )[0]
    m = _manifest(write_batch(step_dir(tmp_path, 1), 0, plain))
    assert {n: f["dtype"] for n, f in m["fields"].items()} == want["arrays"]
    assert set(m["meta"]) == want["meta"]
    assert m["format_version"] == FORMAT_VERSION
    m = _manifest(write_batch(step_dir(tmp_path, 2), 0, routed))
    assert {n: f["dtype"] for n, f in m["fields"].items()} == {**want["arrays"], **want["routed"]}


def test_a_version_1_file_is_refused_on_its_version(written):
    """A leftover file of format 1 (no env_ids / staleness) fails on format_version, not on a missing field."""
    _, path = written
    old = 1

    def downgrade(arrays):
        manifest = json.loads(arrays[MANIFEST_KEY].tobytes().decode("utf-8"))
        for name in set(manifest["fields"]) - set(FORMATS[old]["arrays"]):
            arrays.pop(name)
            manifest["fields"].pop(name)
        manifest["format_version"] = old
        manifest["meta"] = {k: v for k, v in manifest["meta"].items() if k in FORMATS[old]["meta"] | {"step"}}
        arrays[MANIFEST_KEY] = np.frombuffer(json.dumps(manifest).encode("utf-8"), np.uint8)

    _rewrite(path, downgrade)
    with pytest.raises(
        BatchFormatError,
        match=rf"field 'format_version': expected {FORMAT_VERSION}, got {old} "
        r"\(written by another primejax version",
    ):
        read_batch(path)
