"""megatron-id job-prepare, what launch/slurm/train.sbatch and launch/local.sh settle before any
rank starts: job defaults for train.save / train.load, the recorded config, the layout, the
step to resume from, and one task per GPU."""
import subprocess
import sys

import pytest
from conftest import CONFIGS, ROOT

from megatron_id.config import load_config
from megatron_id.training.job import JobLayoutError, prepare, shell_lines

TINY = str(CONFIGS / "model" / "tiny.yaml")


def test_defaults_record_and_resume_step(tmp_path):
    run = tmp_path / "run"
    values = prepare(run, [TINY], ["parallel.tensor_model_parallel_size=2", "train.train_tokens=4096",
                                   "train.global_batch_size=4", "train.micro_batch_size=1"],
                     world_size=4, job_id="12", attempt=0, env={})
    save = str(run / "checkpoints")
    assert values["override"] == [f"train.save={save}", f"train.load={save}",
                                  f"train.metrics_file={run / 'metrics.jsonl'}"]
    assert (values["tensor"], values["pipe"], values["data"], values["step"]) == (2, 1, 2, 0)
    assert (values["micro_batch"], values["accumulation"], values["train_iters"]) == (1, 2, 4096 // (4 * 64))
    record = run / "logs" / "12.0.config.yaml"
    assert values["config_record"] == str(record)
    # the record is the resolved config and loads back to the same thing
    again = load_config([record], [])
    assert again.train.save == save and again.train.load == save and again.parallel.tensor_model_parallel_size == 2
    # a later attempt starts from the step `latest` names
    (run / "checkpoints" / "iter_0000007").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("iter_0000007")
    assert prepare(run, [TINY], [], world_size=1, job_id="12", attempt=1, env={})["step"] == 7
    assert (run / "logs" / "12.1.config.yaml").is_file()


def test_explicit_save_and_load_are_kept(tmp_path):
    values = prepare(tmp_path / "run", [TINY], [f"train.save={tmp_path / 'mine'}"], world_size=1,
                     job_id="1", attempt=0, env={})
    assert values["override"] == [f"train.load={tmp_path / 'mine'}",
                                  f"train.metrics_file={tmp_path / 'run' / 'metrics.jsonl'}"]
    assert values["save"] == str(tmp_path / "mine")
    values = prepare(tmp_path / "run", [TINY], [f"train.save={tmp_path / 'a'}", f"train.load={tmp_path / 'b'}",
                                                f"train.metrics_file={tmp_path / 'm.jsonl'}"],
                     world_size=1, job_id="2", attempt=0, env={})
    assert values["override"] == [] and values["load"] == str(tmp_path / "b")


@pytest.mark.parametrize("tasks,gpus,needle", [("4(x2)", "8", "4 of the 8 GPUs per node would stay idle"),
                                               ("8", "4", "4 GPU(s) per node would hold two ranks")])
def test_tasks_must_match_gpus_per_node(tmp_path, tasks, gpus, needle):
    env = {"SLURM_TASKS_PER_NODE": tasks, "SLURM_GPUS_ON_NODE": gpus}
    with pytest.raises(JobLayoutError, match="One task per GPU") as err:
        prepare(tmp_path, [TINY], [], world_size=8, job_id="1", attempt=0, env=env)
    assert needle in str(err.value) and f"--ntasks-per-node={gpus}" in str(err.value)
    assert not (tmp_path / "logs").exists()   # refused before anything is written
    # matching, or a CPU run, or a job without GPUs: accepted
    prepare(tmp_path, [TINY], [], world_size=8, job_id="1", attempt=0,
            env={"SLURM_TASKS_PER_NODE": f"{gpus}(x2)", "SLURM_GPUS_ON_NODE": gpus})
    prepare(tmp_path, [TINY], [], world_size=8, job_id="1", attempt=0, env={**env, "MEGATRON_ID_DEVICE": "cpu"})
    prepare(tmp_path, [TINY], [], world_size=8, job_id="1", attempt=0, env={"SLURM_TASKS_PER_NODE": tasks})


def test_shell_lines_and_the_command(tmp_path):
    assert shell_lines({"override": ["a=1", "b=2"], "step": 3}) == "override=a=1\noverride=b=2\nstep=3\n"
    with pytest.raises(ValueError, match="newline"):
        shell_lines({"save": "x\ny"})
    done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "job-prepare", "--run-dir", str(tmp_path),
                           "--world-size", "3", "--job-id", "5", "--", "--config", TINY,
                           "parallel.tensor_model_parallel_size=2"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("megatron-id: error: world size 3 does not factor into TP=2"), done.stderr
