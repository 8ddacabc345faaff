"""Device discipline (issue 10): every tensor handed to a torch.distributed collective lives on
the training device. On GPUs the process group is NCCL only and NCCL accepts only CUDA
tensors, so a CPU tensor in a collective stops the run at its first step, and no CPU test run
can see that: the gloo group takes CPU tensors happily. So the rule is checked statically.

The rule, over every function of megatron_id/: a tensor passed to a collective must not be
made by a torch factory (zeros, ones, tensor, full, empty, arange, ...) without `device=`, and
must not be assigned or accumulated from `.cpu()` (or `.to("cpu")`). Object collectives
(`*_object*`) pickle Python objects and are exempt.
"""
import ast

from conftest import ROOT

COLLECTIVES = {"all_reduce", "all_gather", "broadcast", "reduce", "reduce_scatter", "all_to_all",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter"}
FACTORIES = {"zeros", "ones", "tensor", "full", "empty", "arange", "rand", "randn", "as_tensor"}


def _is_cpu_move(node) -> bool:
    """x.cpu() or x.to('cpu') anywhere inside `node`."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
            if sub.func.attr == "cpu":
                return True
            if sub.func.attr == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in sub.args):
                return True
    return False


def _cpu_factory(node) -> bool:
    """torch.zeros(...) and friends without device=."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and node.func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords))


def violations(source: str, filename: str = "<source>") -> list[str]:
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned: dict[str, list] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            # `a, b = torch.zeros(1), 0` assigns element-wise
                            value = node.value
                            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                                    and len(target.elts) == len(value.elts) and name in target.elts:
                                value = value.elts[target.elts.index(name)]
                            assigned.setdefault(name.id, []).append(value)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name) \
                    and node.value is not None:
                assigned.setdefault(node.target.id, []).append(node.value)
        for call in ast.walk(func):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in COLLECTIVES and isinstance(call.func.value, ast.Name)
                    and call.func.value.id == "dist" and call.args):
                continue
            arg = call.args[0]
            values = assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [arg]
            for value in values:
                where = f"{filename}:{call.lineno}: dist.{call.func.attr}({ast.unparse(arg)})"
                if _cpu_factory(value):
                    found.append(f"{where}: made by {ast.unparse(value)} without device= (a CPU tensor)")
                elif _is_cpu_move(value):
                    found.append(f"{where}: fed from {ast.unparse(value)}, which moves it to the CPU")
    return found


def test_no_collective_in_megatron_id_takes_a_cpu_tensor():
    problems = []
    for path in sorted((ROOT / "megatron_id").rglob("*.py")):
        problems += violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


# The collectives of training/engine.py as they were before issue 10 (every GPU run would have
# stopped at its first step): the check must catch each of them.
ENGINE_BEFORE_ISSUE_10 = '''
def _train_batch(self):
    total = torch.zeros(1)
    for _ in range(self.layout.gradient_accumulation):
        loss = self._loss(self._batch(self.train_data, next(self.sampler)))
        total += loss.detach().float().cpu()
    dist.all_reduce(total, group=state.get_data_parallel_group())

def evaluate(self):
    total, count = torch.zeros(1), 0
    for indices in sampler:
        total += self._loss(self._batch(self.valid_data, indices)).float().cpu()
    dist.all_reduce(total, group=state.get_data_parallel_group())

def _stop_agreed(self):
    flag = torch.tensor([1.0 if self.stop_requested else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
'''


def test_the_check_catches_the_engine_before_the_fix():
    found = violations(ENGINE_BEFORE_ISSUE_10)
    assert any("dist.all_reduce(total)" in f and "torch.zeros(1) without device=" in f for f in found), found
    assert any("moves it to the CPU" in f for f in found), found
    assert any("dist.all_reduce(flag)" in f and "torch.tensor" in f for f in found), found
    assert len(found) == 5, found   # two per accumulated total, one for the flag


def test_the_check_accepts_device_tensors():
    ok = '''
def step(self):
    total = torch.zeros(1, device=self.device)
    total += loss.detach().float()
    dist.all_reduce(total)
    flag = torch.tensor([1.0], device=self.device)
    dist.all_reduce(flag)
    names = [sorted(files)]
    dist.broadcast_object_list(names, src=0)
'''
    assert violations(ok) == []
