"""moe-rl commands run with "the GPU" a stand-in accelerator (``tests/support/fake_device.py``),
so that a CPU tensor meeting a device tensor fails here as it would on CUDA.

    python tests/support/device_discipline_checks.py [--ranks N] COMMAND ARGS... [+ COMMAND ARGS...]
    python tests/support/device_discipline_checks.py selftest

Each ``+``-separated moe-rl command runs in this process, in turn, under the stand-in
device (``--ranks N``: N local ranks, each running them all). Prints one JSON line per
rank: the commands' exit codes and how many device tensors were made.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from fake_device import FAKE_DEVICE, DeviceDisciplineError, OnDevice, on_fake_device  # noqa: E402


def selftest() -> dict:
    """What the stand-in device refuses and allows, as CUDA does."""
    with on_fake_device() as device:
        x = torch.ones(3, device=device)
        facts = {"device": str(x.device), "sum": float((x * 2).sum().item())}
        for name, bad in (("host_operand", lambda: x + torch.ones(3)), ("numpy", lambda: x.numpy())):
            try:
                bad()
                facts[name] = "allowed"
            except DeviceDisciplineError:
                facts[name] = "refused"
        facts["host_scalar"] = float((x * torch.tensor(2.0)).sum())  # 0-dim CPU tensors are scalars
        facts["to_host"] = str(x.cpu().device)
        linear = torch.nn.Linear(3, 2).to(device)
        linear(x[None]).sum().backward()
        facts["grad_device"] = str(linear.weight.grad.device)
        facts["tolist"] = torch.arange(2, device=device).tolist()
    return facts


def run_commands(argv: list[str]) -> dict:
    from moe_rl import cli
    from parallel import cpu_bridge

    cpu_bridge.install(FAKE_DEVICE)
    commands, current = [], []
    for arg in argv:
        if arg == "+":
            commands.append(current)
            current = []
        else:
            current.append(arg)
    commands.append(current)
    codes = []
    with on_fake_device():
        for command in commands:
            codes.append(cli.main(command))
    return {"codes": codes, "device_tensors": OnDevice.made}


def main(argv: list[str]) -> int:
    if argv[:1] == ["selftest"]:
        print(json.dumps(selftest()), flush=True)
        return 0
    if argv[:1] == ["--ranks"]:
        from parallel.launch import spawn_local

        return spawn_local(int(argv[1]), [__file__, *argv[2:]])
    result = json.dumps(run_commands(argv)) + "\n"
    sys.stdout.flush()
    os.write(1, result.encode())  # one write: ranks share the output file, a print could interleave
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: autograd's worker thread for the stand-in device type is
    # still alive then, and its destruction aborts the process now and then
    # ("terminate called without an active exception")
    os._exit(code)
