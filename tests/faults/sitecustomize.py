"""Test-only fault injection for the processes that tests start: tests/conftest.py puts this
directory first on PYTHONPATH, so every Python process a test spawns (torchrun's ranks, the
ablation's ranks) runs this at startup. pyfast itself has no hook: this wraps the functions the
ranks call, as their modules load. Without the variables below it does nothing.

  PYFAST_FAULT="POINT@STEP[:RANK]"  SIGKILL at POINT on RANK (default every rank), in the first
      attempt only (torchrun restarts must get through): "step" after that step's update
      (pyfast.train.job.Job.train_step returned), "ckpt" with the checkpoint's shards written
      but not committed (pyfast.train.checkpoint's dcp.save returned).
  PYFAST_ABLATE_FAULT="CELL@STEP"   SIGKILL the last rank after that step of that cell
      (the train step of the job pyfast.ablate.cell builds). Its hook is installed in every
      process and reads the variable at each step: an ablation's ranks are forked from a
      server (pyfast._forked) that started before the test set it.
"""
import os
import sys


def _kill(why: str) -> None:
    import signal

    import torch.distributed as dist
    # said first: torchrun reports whichever rank it sees fail first, and a survivor raising
    # CommError (within ~0.05 s of the kill) can be that one
    print(f"pyfast: {why}: SIGKILL rank {dist.get_rank()}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _fault(point: str, step: int) -> None:
    spec = os.environ.get("PYFAST_FAULT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    import torch.distributed as dist
    where, _, rank = spec.partition(":")
    p, _, s = where.partition("@")
    if p == point and int(s) == step and (not rank or int(rank) == dist.get_rank()):
        _kill(f"PYFAST_FAULT {spec}")


def _job(mod) -> None:
    step_once = mod.Job.train_step

    def train_step(self, step, *args, **kwargs):
        rec = step_once(self, step, *args, **kwargs)
        _fault("step", step)
        return rec
    mod.Job.train_step = train_step


def _checkpoint(mod) -> None:
    import re
    real = mod.dcp

    class DCP:  # the module's dcp, whose save dies at "ckpt" once the shards are written
        def __getattr__(self, name):
            return getattr(real, name)

        def save(self, *args, checkpoint_id=None, **kwargs):
            out = real.save(*args, checkpoint_id=checkpoint_id, **kwargs)
            m = re.search(r"\.tmp-step-(\d+)$", str(checkpoint_id))
            if m:
                _fault("ckpt", int(m.group(1)))
            return out
    mod.dcp = DCP()


def _cell(mod) -> None:
    build = mod.build

    def build_failing(cell, *args, **kwargs):
        tj = build(cell, *args, **kwargs)
        step_once = tj.train_step

        def train_step(step, *a, **k):
            rec = step_once(step, *a, **k)
            import torch.distributed as dist
            spec = os.environ.get("PYFAST_ABLATE_FAULT", "")
            if spec == f"{cell['cell']}@{step}" and \
                    dist.get_rank() == dist.get_world_size() - 1:
                _kill(f"PYFAST_ABLATE_FAULT {spec}")
            return rec
        tj.train_step = train_step
        return tj
    mod.build = build_failing


def _install(patches: dict) -> None:
    """Run patches[name](module) right after module `name` is first executed."""
    import importlib.abc

    class After(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in patches:
                return None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        break
            else:
                return None
            patch, run = patches.pop(name), spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module  # this spec's own loader instance
            return spec
    sys.meta_path.insert(0, After())


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the interpreter has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in sys.path:
        f = os.path.join(d or ".", "sitecustomize.py")
        if os.path.abspath(d or ".") != here and os.path.isfile(f):
            with open(f) as src:
                exec(compile(src.read(), f, "exec"), {"__name__": "sitecustomize", "__file__": f})
            return


patches = {}
if os.environ.get("PYFAST_FAULT"):
    patches.update({"pyfast.train.job": _job, "pyfast.train.checkpoint": _checkpoint})
patches["pyfast.ablate.cell"] = _cell  # reads PYFAST_ABLATE_FAULT when a step ends
_install(patches)
_chain()
