"""Build the kernel extension and the compiled data-path modules. Cython runs at build time; no generated C is
committed.

Never ``-march=native``: one build must run on any x86-64 (or arm64). The SIMD paths are compiled with GCC/Clang
function target attributes and chosen at run time by CPU detection, so the baseline flags stay generic.
``-ffp-contract=off`` keeps the compiler from fusing multiply-adds, so every backend rounds exactly like the
numpy reference (kvd/codec/reference.py). The extension is ``kvd.codec._kernels``; ``kvd.wire._flatwire`` is the
typed twin of the wire codec's fast path (its Python twin: kvd/wire/protocol.py).

The modules listed in kvd/_native.py (COMPILED, dotted names below ``kvd``) are plain Python, also compiled as
they are: Python semantics (no C typing from annotations, no unchecked indexing), only the interpreter's dispatch
goes. ``KVD_PURE_PYTHON=1`` builds the kernels only.
"""

import os
import runpy
import sys
from glob import glob
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

# -g0: no debug information (Python's own CFLAGS ask for -g): it was a third of the compile time (16.6 s against
# 11.7 s for kvd/store/core.c) and changes nothing that runs.
compile_args = ["-O3", "-g0", "-ffp-contract=off", "-fno-fast-math", "-std=c11", "-Wall", "-Wno-unused-function"]
if sys.platform == "win32":  # pragma: no cover - not a supported server platform, kept buildable
    compile_args = ["/O2", "/fp:precise"]

kernels = cythonize(
    [
        Extension(
            "kvd.codec._kernels",
            sources=["cython_ext/_kernels.pyx"],
            depends=sorted(glob("cython_ext/*.h") + glob("cython_ext/*.pxi")),  # rebuild when the kernels change
            include_dirs=["cython_ext", np.get_include()],
            extra_compile_args=compile_args,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        ),
        # the typed twin of the wire codec's fast path (kvd/wire/protocol.py); always built, like the kernels
        Extension("kvd.wire._flatwire", sources=["cython_ext/_flatwire.pyx"],
                  depends=sorted(glob("cython_ext/flatwire/*.pxi")), extra_compile_args=compile_args),
    ],
    compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False, "cdivision": True},
)

native = runpy.run_path(os.path.join("kvd", "_native.py"))
modules = []
if not native["pure_requested"](os.environ):
    modules = cythonize(
        [
            # -O1: half the compile time of -O2 at no measured cost (what they save is the interpreter's
            # dispatch, not arithmetic): design.md, "The test run on two cores".
            Extension(f"kvd.{name}", [str(native["source_file"](Path("kvd"), name))],
                      extra_compile_args=["-O1", "-g0"])
            for name in native["COMPILED"]
        ],
        # Python semantics exactly: annotations stay annotations, functions stay introspectable
        compiler_directives={"language_level": "3", "annotation_typing": False, "binding": True},
        nthreads=os.cpu_count() or 1,
        quiet=True,
    )

setup(ext_modules=kernels + modules, options={"build_ext": {"parallel": os.cpu_count() or 1}})
