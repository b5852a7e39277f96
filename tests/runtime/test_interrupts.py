"""Ctrl-C during ``dispatch``: a real signal (SIGALRM raising KeyboardInterrupt, as SIGINT does)
delivered at moments spread over the whole call — planning, the traced forward, the store's
writing, the hooks — in a fresh process. Wherever it lands, the interrupt reaches the caller,
the model gives its plain outputs with no hook of automap's left on it, torch's global mode
stacks are empty, no store the call began is left in ``offload_dir`` (the user's file there
is kept), and the next dispatch into the same folder works."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from pathlib import Path

from tiny_configs import beside_the_run

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import faulthandler, json, os, shutil, signal, sys, time
    import torch
    from torch import nn
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    import automap
    from automap.runtime import state_of

    root, count, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)]).eval()

    def interrupt(signum, frame):
        raise KeyboardInterrupt("alarm")

    signal.signal(signal.SIGALRM, interrupt)
    faulthandler.dump_traceback_later(540, exit=True)  # a hang shows where each thread waits
    x = torch.randn(2, 256)
    expected = build()(x)
    budget = {"cpu": cpu}  # 1 MB of weights beside the run, most layers on disk: a store is written
    times = []
    for k in range(4):  # the first call pays for imports: the median of the rest
        warm = build()
        start = time.perf_counter()
        automap.dispatch(warm, max_memory=budget, offload_dir=os.path.join(root, f"warm{k}"))
        times.append(time.perf_counter() - start)
        automap.undispatch(warm)
    took = sorted(times[1:])[1]
    problems, landed = [], 0
    for i in range(count):
        folder = os.path.join(root, str(i))
        os.makedirs(folder)
        with open(os.path.join(folder, "mine.txt"), "w") as f:
            f.write("the user's")
        model = build()
        interrupted = False
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, max(took * 1.1 * i / count, 1e-5))
                automap.dispatch(model, max_memory=budget, offload_dir=folder)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:  # in dispatch, or just after it returned: either way all or nothing
            interrupted = True
        dispatched = state_of(model) is not None
        landed += interrupted and not dispatched
        where = f"#{i} ({'interrupted' if interrupted else 'completed'}, {'dispatched' if dispatched else 'not dispatched'})"
        if _get_current_dispatch_mode_stack() or _get_current_function_mode_stack():
            problems.append(f"{where}: a torch mode stays on the global stack")
        try:
            if not torch.equal(model(x), expected):
                problems.append(f"{where}: other outputs")
        except BaseException as exc:
            problems.append(f"{where}: forward raised {type(exc).__name__}: {exc}")
        if not dispatched:
            hooks = [n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__]
            if hooks:
                problems.append(f"{where}: hooks left: {hooks[:3]}")
            left = [e for e in os.listdir(folder) if e != "mine.txt"]
            if left:
                problems.append(f"{where}: left in offload_dir: {left}")
        else:
            automap.undispatch(model)
        if open(os.path.join(folder, "mine.txt")).read() != "the user's":
            problems.append(f"{where}: the user's file changed")
        try:
            automap.dispatch(model, max_memory=budget, offload_dir=folder)
            if not torch.equal(model(x), expected):
                problems.append(f"{where}: the next dispatch gives other outputs")
            automap.undispatch(model)
        except BaseException as exc:
            problems.append(f"{where}: the next dispatch raised {type(exc).__name__}: {exc}")
        shutil.rmtree(folder)
    print(json.dumps({"problems": problems, "interrupted": landed, "count": count}))
""")


def _budget() -> str:
    """The scripts' CPU budget: 1 MB of their model's 3.2 MB of weights beside its run."""
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)]).eval()
    return str(beside_the_run(model, 10**6))


def test_an_interrupt_anywhere_in_dispatch_leaves_the_model_the_folder_and_torch_as_they_were(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), "64", _budget()],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["interrupted"] >= result["count"] // 2, f"the alarms fell after the calls: {result}"
    assert result["problems"] == [], result["problems"]


LOAD_SCRIPT_TEMPLATE = textwrap.dedent("""
    import dis, faulthandler, json, os, shutil, signal, sys
    import torch
    from torch import nn
    import automap
    from automap.runtime import state_of

    root, count, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    PACKAGE = os.path.dirname(automap.__file__)

    def build():
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)]).eval()

    def interrupt(signum, frame):
        raise KeyboardInterrupt("alarm")

    def skeleton():
        with automap.empty_model():
            return build()

    TRACER

    signal.signal(signal.SIGALRM, interrupt)
    faulthandler.dump_traceback_later(780, exit=True)  # a hang shows where each thread waits
    torch.manual_seed(0)
    real = build()
    x = torch.randn(2, 256)
    with torch.no_grad():
        expected = real(x)
    checkpoint = os.path.join(root, "pytorch_model.bin")  # a pickle: offloaded tensors are written to a store
    torch.save(real.state_dict(), checkpoint)
    budget = {"cpu": cpu}  # 1 MB of weights beside the run: most layers on disk

    def load(model, folder, tracer=None):
        sys.settrace(tracer)
        try:
            return automap.load(model, checkpoint, max_memory=budget, offload_dir=folder, quiet=True)
        finally:
            sys.settrace(None)

    counter = AtStatement(0)
    for k in range(2):  # the first call pays for imports: the second's statements are counted
        warm = skeleton()
        counter.seen = 0
        load(warm, os.path.join(root, f"warm{k}"), counter)
        automap.undispatch(warm)
    total = counter.seen
    # Half the moments spread over the whole call, half over its last steps: from the reading of
    # the tensors' end (the model's tensors installed) to the dispatch's start, where the store
    # and the installed tensors are this call's to undo.
    start, end = counter.first["install"] - 300, counter.first["dispatch_plan"] + 100
    half = count // 2
    moments = [1 + (total - 1) * i // (half - 1) for i in range(half)]
    moments += [start + (end - start) * i // (count - half - 1) for i in range(count - half)]
    problems, landed = [], 0
    for i in range(count):
        folder = os.path.join(root, str(i))
        os.makedirs(folder)
        with open(os.path.join(folder, "mine.txt"), "w") as f:
            f.write("the user's")
        model = skeleton()
        interrupted = False
        try:
            load(model, folder, AtStatement(moments[i]))
        except KeyboardInterrupt:
            interrupted = True
        dispatched = state_of(model) is not None
        landed += interrupted and not dispatched
        where = f"#{i} ({'interrupted' if interrupted else 'completed'}, {'loaded' if dispatched else 'not loaded'})"
        if dispatched:
            with torch.no_grad():
                if not torch.equal(model(x), expected):
                    problems.append(f"{where}: other outputs")
            automap.undispatch(model)
        else:
            real_ones = [n for n, p in model.named_parameters() if p.device.type != "meta"]
            if real_ones:
                problems.append(f"{where}: half loaded: {real_ones[:3]} are real, the rest meta")
            hooks = [n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]
            if hooks:
                problems.append(f"{where}: hooks left: {hooks[:3]}")
            left = [e for e in os.listdir(folder) if e != "mine.txt"]
            if left:
                problems.append(f"{where}: left in offload_dir: {left}")
        if open(os.path.join(folder, "mine.txt")).read() != "the user's":
            problems.append(f"{where}: the user's file changed")
        try:
            again = skeleton() if dispatched else model
            load(again, folder)
            with torch.no_grad():
                if not torch.equal(again(x), expected):
                    problems.append(f"{where}: the next load gives other outputs")
            automap.undispatch(again)
        except BaseException as exc:
            problems.append(f"{where}: the next load raised {type(exc).__name__}: {exc}")
        shutil.rmtree(folder)
    print(json.dumps({"problems": problems, "interrupted": landed, "count": count, "statements": total}))
""")


# A real SIGALRM as automap's statement number N is about to run (sys.settrace), shared by the
# scripts that sample every statement of a call.
TRACER = textwrap.dedent('''
EXITS = {}

def with_exit(frame):
    """Whether the line event is a ``with`` block's end, about to call ``__exit__`` (the
    three None arguments, then the call): an exception raised there by a trace function
    skips ``__exit__``, which no real signal can do (the interpreter runs handlers at
    calls and jumps, not between a block's last statement and its ``__exit__``)."""
    code = frame.f_code
    if code not in EXITS:
        ops = list(dis.get_instructions(code))
        EXITS[code] = {
            a.offset for a, b, c, d in zip(ops, ops[1:], ops[2:], ops[3:])
            if all(i.opname == "LOAD_CONST" and i.argval is None for i in (a, b, c))
            and d.opname in ("PRECALL", "CALL") and d.arg == 2
        }
    return frame.f_lasti in EXITS[code]

class AtStatement:
    """Sends this process a real SIGALRM as automap's statement number ``target`` is about
    to run (statements of automap's own code, counted in this thread): every moment of the
    call can be chosen, the short steps between two calls included."""

    def __init__(self, target):
        self.target, self.seen, self.first = target, 0, {}

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "call":  # where the steps that end a load begin
            self.first.setdefault(frame.f_code.co_name, self.seen)
        if event == "line" and not with_exit(frame):
            self.seen += 1
            if self.seen == self.target:
                os.kill(os.getpid(), signal.SIGALRM)
        return self

''')
LOAD_SCRIPT = LOAD_SCRIPT_TEMPLATE.replace("TRACER\n", TRACER)


def test_an_interrupt_at_any_statement_of_load_leaves_the_skeleton_and_the_folder_as_they_were(tmp_path):
    """64 moments chosen among the statements automap runs in a load (planning, the checkpoint's
    reading, the store's writing, the install, the dispatch), each a real signal: half spread
    over the whole call, half over the steps from the tensors' install to the dispatch."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(tmp_path), "64", _budget()],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["interrupted"] >= result["count"] // 2, f"the signals fell after the calls: {result}"
    assert result["problems"] == [], result["problems"]


UNDO_SCRIPT = textwrap.dedent("""
    import dis, faulthandler, json, os, shutil, signal, sys
    import torch
    from torch import nn
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    import automap
    from automap.runtime import state_of

    root, count, cpu, call = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    PACKAGE = os.path.dirname(automap.__file__)

    def interrupt(signum, frame):
        raise KeyboardInterrupt("alarm")

    TRACER

    signal.signal(signal.SIGALRM, interrupt)
    faulthandler.dump_traceback_later(500, exit=True)  # a hang shows where each thread waits

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)]).eval()

    x = torch.randn(2, 256)
    with torch.no_grad():
        expected = build()(x)
    budget = {"cpu": cpu}  # most layers on disk: a store is written and mapped

    def traced(work, tracer):
        sys.settrace(tracer)
        try:
            return work()
        finally:
            sys.settrace(None)

    def ready(folder):
        model = build()
        if call == "undispatch":
            automap.dispatch(model, max_memory=budget, offload_dir=folder)
        return model

    def the_call(model):
        if call == "undispatch":
            return automap.undispatch(model)
        return automap.plan(model, max_memory=budget, example_inputs=(x,))

    counter = AtStatement(0)
    for k in range(2):  # the first call pays for imports: the second's statements are counted
        model = ready(os.path.join(root, f"warm{k}"))
        counter.seen = 0
        traced(lambda: the_call(model), counter)
    total = counter.seen
    moments = [1 + (total - 1) * i // (count - 1) for i in range(count)]
    problems, landed = [], 0
    for i in range(count):
        folder = os.path.join(root, str(i))
        os.makedirs(folder)
        with open(os.path.join(folder, "mine.txt"), "w") as f:
            f.write("the user's")
        model = ready(folder)
        before = state_of(model) is not None
        interrupted = False
        try:
            traced(lambda: the_call(model), AtStatement(moments[i]))
        except KeyboardInterrupt:
            interrupted = True
        dispatched = state_of(model) is not None
        landed += interrupted and dispatched == before
        where = f"#{i} ({'interrupted' if interrupted else 'completed'}, {'dispatched' if dispatched else 'plain'})"
        if _get_current_dispatch_mode_stack() or _get_current_function_mode_stack():
            problems.append(f"{where}: a torch mode stays on the global stack")
        if call == "plan" and dispatched:
            problems.append(f"{where}: plan dispatched the model")
        try:
            with torch.no_grad():
                if not torch.equal(model(x), expected):
                    problems.append(f"{where}: other outputs")
            if dispatched:
                automap.undispatch(model)
        except BaseException as exc:
            problems.append(f"{where}: the model raised {type(exc).__name__}: {exc}")
        hooks = [n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__]
        if hooks:
            problems.append(f"{where}: hooks left once undone: {hooks[:3]}")
        unreal = [n for n, p in model.named_parameters() if p.device.type != "cpu" or p.is_meta]
        if unreal:
            problems.append(f"{where}: parameters not back in RAM: {unreal[:3]}")
        if open(os.path.join(folder, "mine.txt")).read() != "the user's":
            problems.append(f"{where}: the user's file changed")
        try:
            again = build()
            automap.dispatch(again, max_memory=budget, offload_dir=folder)
            with torch.no_grad():
                if not torch.equal(again(x), expected):
                    problems.append(f"{where}: the next dispatch gives other outputs")
            automap.undispatch(again)
        except BaseException as exc:
            problems.append(f"{where}: the next dispatch raised {type(exc).__name__}: {exc}")
        shutil.rmtree(folder)
    print(json.dumps({"problems": problems, "interrupted": landed, "count": count, "statements": total}))
""").replace("TRACER\n", TRACER)


@pytest.mark.parametrize("call", ["undispatch", "plan"])
def test_an_interrupt_at_any_statement_of_undispatch_or_plan_leaves_the_state_before_or_after(tmp_path, call):
    """40 moments spread over every statement automap runs in the call, each a real signal:
    the model is dispatched and works (the state before ``undispatch``) or is plain and works
    (after it); a plan leaves the model as it was; the next dispatch into the folder works."""
    done = subprocess.run(
        [sys.executable, "-c", UNDO_SCRIPT, str(tmp_path), "40", _budget(), call],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["interrupted"] >= result["count"] // 2, f"the signals fell after the calls: {result}"
    assert result["problems"] == [], result["problems"]
