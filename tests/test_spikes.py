"""Loss spikes (issue 53, training/spikes.py): a poisoned batch's update is skipped and logged
with its global sample indices, a resume meets and skips the same samples, and M spikes roll
back to the last checkpoint and go on with their batches skipped, exactly as a run started
from that checkpoint with those samples skipped."""
import re
import shutil

import pytest
from conftest import CONFIGS
from distributed import run_distributed

from megatron_id.config import load_config
from megatron_id.data.gpt_dataset import PretrainingSampler, stream_positions
from megatron_id.training.faults import ENV, FaultSpecError, parse_faults

BATCH = 4   # global batch: step s reads samples 4(s-1) .. 4s-1 while nothing is skipped


def items(prefix, steps, save, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            "train.zero_stage=0", "train.precision=fp32", "train.micro_batch_size=2",
            f"train.global_batch_size={BATCH}", f"train.train_tokens={steps * BATCH * 64}", "optimizer.lr=1e-2",
            "optimizer.warmup_tokens=512", "optimizer.min_lr=1e-3", "train.eval_iters=0", "train.log_interval=1",
            f"train.save={save}", f"train.load={save}", "train.save_interval=4", "train.keep_last=0",
            "train.spike_factor=5", "train.spike_window=3", *extra]


def _run(rank, world, items, skipped=None):
    """Train to the end; per step run: (step, loss, weights unchanged by it). skipped: sample
    ranges set by hand on the resumed run (the expected run of a rollback)."""
    import torch

    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    if skipped is not None:
        trainer.spikes.skipped = [tuple(r) for r in skipped]
        trainer._restart_sampler()
    step_fn, record = trainer.train_step, []

    def observed_step():
        before = [p.detach().clone() for p in trainer.engine.module.parameters()]
        loss = step_fn()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.engine.module.parameters()))
        record.append((trainer.step, loss, unchanged))
        return loss
    trainer.train_step = observed_step
    trainer.train()
    trainer.close()
    return record, trainer.guard.updates, trainer.spikes.state()


def resume_copy(source, step, folder):
    """A train.save folder holding `source`'s checkpoint of `step` as its latest (the kill point)."""
    tag = f"iter_{step:07d}"
    shutil.copytree(source / tag, folder / tag)
    (folder / "latest").write_text(tag)
    return folder


def test_stream_positions_and_sampler_skip_ranges():
    assert stream_positions(0, 6, [(2, 4)]) == [0, 1, 4, 5, 6, 7]
    assert stream_positions(1, 3, [(0, 2), (4, 6)]) == [3, 6, 7]
    assert stream_positions(3, 4, [(0, 2), (4, 6), (6, 8)]) == [9, 10, 11, 12]
    sampler = PretrainingSampler(8, 4, 2, data_parallel_rank=1, data_parallel_size=2, skipped=[(4, 8)])
    assert list(sampler) == [[2, 3]]   # positions 4-7 fall on 8-11, past the end: wrapped to 0-3
    with pytest.raises(FaultSpecError, match="step or sample"):
        parse_faults("spike:factor=1000")
    assert parse_faults("spike:sample=21:factor=1000")[0].values == {"sample": 21, "factor": 1000.0}


@pytest.mark.slow
def test_poisoned_batch_is_skipped_logged_and_skipped_again_on_resume(fineweb_prefix, tmp_path, monkeypatch, capfd):
    """On 2 pipeline stages: the poison goes through the last stage's loss, and the first stage,
    which sees no loss, skips the same update (the decision is agreed in the guard's all-reduce)."""
    pp = "parallel.pipeline_model_parallel_size=2"
    run = lambda save: run_distributed(_run, 2, args=(items(fineweb_prefix, 8, save, pp),), timeout=300)  # noqa: E731
    clean = run(tmp_path / "clean")[0]
    monkeypatch.setenv(ENV, "spike:sample=21:factor=1000")   # in step 6's batch (samples 20-23)
    ranks = run(tmp_path / "spiky")
    first = capfd.readouterr().err
    record, updates, spikes = ranks[0]
    losses = [loss for _, loss, _ in record]
    assert losses[:5] == [loss for _, loss, _ in clean[0][:5]]
    assert losses[5] == pytest.approx(1000 * clean[0][5][1], rel=1e-5)   # the real step, its loss x1000
    for record, updates, spikes in ranks:   # each stage's weights: unchanged by step 6 only (step 1: LR 0)
        assert [unchanged for _, _, unchanged in record[1:]] == [False] * 4 + [True] + [False] * 2
        assert (updates, clean[1]) == (7, 8)   # one update fewer than the run without the poison
        assert spikes["count"] == 1 and spikes["skipped"] == []   # skipped, not rolled back (M=3)
    assert "step 6: loss spike (loss" in first and "update skipped; global samples 20-23" in first
    # killed after step 4's checkpoint: the resumed run meets the same samples and skips them again
    again = run(resume_copy(tmp_path / "spiky", 4, tmp_path / "resumed"))
    assert [r[:2] for r in again] == [(ranks[r][0][4:], 3) for r in range(2)]   # steps 5, 7 and 8 update
    assert re.search(r"step 6: loss spike \(loss .*\), update skipped; global samples 20-23\n", capfd.readouterr().err)


@pytest.mark.slow
def test_spikes_roll_back_to_the_checkpoint_and_resume_exactly(fineweb_prefix, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(ENV, "spike:sample=21:factor=1000; spike:sample=25:factor=1000")   # steps 6 and 7
    save = tmp_path / "run"
    rollback = ["train.spike_rollback_after=2", "train.spike_rollback_window=10"]
    run = items(fineweb_prefix, 10, save, *rollback)
    record, _, spikes = run_distributed(_run, 1, args=(run,), timeout=300)[0]
    err = capfd.readouterr().err
    assert [step for step, _, _ in record] == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10]
    assert f"rolled back to {save / 'iter_0000004'} (step 4) after loss spikes at steps 6, 7" in err
    assert "skipping global samples 20-23; 24-27 from now on" in err
    assert spikes["skipped"] == [[20, 24], [24, 28]] and spikes["count"] == 2 and spikes["rollbacks"] == 1
    after = record[7:]
    assert after[0][1] == record[4][1]   # step 5 again: the same weights and data, the same loss
    assert not any(unchanged for _, _, unchanged in after)   # nothing poisoned is met again
    # expected: a run started from that checkpoint with those samples skipped, number for number
    expected = resume_copy(save, 4, tmp_path / "expected")
    want, _, _ = run_distributed(_run, 1, args=(items(fineweb_prefix, 10, expected), [[20, 24], [24, 28]]),
                                 timeout=300)[0]
    assert want == after
    # killed after step 8's checkpoint (after the rollback): the resume skips the same samples
    resumed = resume_copy(save, 8, tmp_path / "resumed")
    again, _, state = run_distributed(_run, 1, args=(items(fineweb_prefix, 10, resumed, *rollback),), timeout=300)[0]
    assert again == after[-2:] and state["skipped"] == spikes["skipped"]
