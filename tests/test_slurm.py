"""SLURM launcher renders the sbatch lines the pitfalls require (engineering.md P8-P11)."""

import importlib.util

from conftest import ROOT


def _launch():
    spec = importlib.util.spec_from_file_location("launch", ROOT / "slurm" / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_render_has_requeue_signal_and_one_task_per_gpu(tmp_path):
    launch = _launch()
    args, ov = launch.parse(["--name", "r1", "--nodes", "2", "--gpus-per-node", "4", "--partition", "p",
                             "--log-dir", str(tmp_path), "--", "experiment=depo1_N375", "canon=ABCD"])
    s = launch.render(args, ov)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --signal=USR2@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --partition=p"):
        assert line in s.splitlines(), line
    cmd = [ln for ln in s.splitlines() if ln.startswith("srun ")][0]
    for tok in ("experiment=depo1_N375", "canon=ABCD", "run_name=r1", "ckpt_path=auto", "trainer.num_nodes=2",
                "trainer.devices=4"):
        assert tok in cmd.split(), tok


def test_existing_name_is_not_reused(tmp_path, capsys):
    launch = _launch()
    (tmp_path / "slurm" / "r1").mkdir(parents=True)
    assert launch.main(["--name", "r1", "--log-dir", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err
