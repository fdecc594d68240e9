"""Builds, once at install time, the DeepSpeed C++ op that CPU training uses (its shared-memory all-reduce), so no
training run waits on a JIT build. The build is cached under ~/.cache/torch_extensions; GPU installs skip it."""

from __future__ import annotations

import time


def main() -> None:
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        print("prebuild: not a CPU install, nothing to build")
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        print("prebuild: DeepSpeed's shared-memory comm op does not apply here")
        return
    start = time.perf_counter()
    builder.load(verbose=False)
    print(f"prebuild: DeepSpeed {builder.absolute_name()} ready ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
