"""Work-around for a DeepSpeed 0.19.8 bug that stops stage 3 + offload_param=nvme in fp32 on CPU
(used only for the ds3_nvme rows marked "dtype fix" in bench/RESULTS.md; put this folder on
PYTHONPATH to apply it).

deepspeed/runtime/zero/partition_parameters.py, InsertPostInitMethodToModuleSubClasses._set_dtype:

    self.dtype = dtype or torch.float16 if get_accelerator().is_fp16_supported(
    ) else torch.bfloat16 if get_accelerator().is_bf16_supported else torch.float32

parses as `(dtype or fp16) if is_fp16_supported() else (bf16 if is_bf16_supported else fp32)`;
on the CPU accelerator is_fp16_supported() is falsy and `is_bf16_supported` (not called) is a
bound method, so the dtype the engine passes (the model's, fp32) is ignored and zero.Init runs
in bf16: the NVMe parameter swapper then stores the fp32 parameters as bf16 and the first Linear
fails with "expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16".

The fix honours an explicit dtype (what the `dtype or ...` intends) and leaves every other case
to DeepSpeed's code. It patches the class when DeepSpeed imports the module (an import hook), so
nothing is imported early (the harness wraps torch.distributed before DeepSpeed is imported).
"""

import importlib.abc
import importlib.machinery
import sys

_TARGET = "deepspeed.runtime.zero.partition_parameters"


def _patch(mod) -> None:
    cls = mod.InsertPostInitMethodToModuleSubClasses
    original = cls._set_dtype

    def _set_dtype(self, ds_config, dtype):
        if dtype is not None:
            self.dtype = dtype
            return
        original(self, ds_config, dtype)

    cls._set_dtype = _set_dtype
    print("[ds_dtype_fix] patched InsertPostInitMethodToModuleSubClasses._set_dtype (explicit dtype honoured)",
          file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
