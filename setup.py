"""kvfence is one distribution whose namespace package ``kvfence`` is spread over two source roots:
``operator/`` (API, operator, router) and ``engine-image/`` (contract, isolation core, reference engine,
vLLM plugin). setuptools' declarative config cannot map one namespace onto two roots, so this file does
that mapping, and declares the compiled modules: the prefix cache's verified walk (``_prefix_walk.c``,
linked against OpenSSL's libcrypto) and the vLLM fence's prefix-cache records (``_records.c``); everything
else lives in pyproject.toml.

Both are built against CPython's stable ABI (``Py_LIMITED_API`` of 3.11, the oldest Python kvfence
supports), and the wheel is tagged ``cp311-abi3``: one wheel loads in CPython 3.11 and every later
release, so the GPU vLLM image (whose Python is vLLM's own, not the one that builds the wheel) installs
the same compiled modules that the tests and benchmarks here run."""

from setuptools import Extension, find_namespace_packages, setup

#: CPython 3.11's stable ABI: the C sources refuse to build without it.
LIMITED_API = ("Py_LIMITED_API", "0x030B0000")
ABI3_TAG = "cp311"
#: a function the limited API does not declare is an error, not an implicit int-returning declaration;
#: -fno-plt: the stable ABI reads every list item and int through a call into libpython, and a call
#: through the GOT skips the PLT's extra jump (bench/bench_records.py: the list walks 10-20% faster)
COMPILE_ARGS = [
    "-O2",
    "-fno-plt",
    "-Werror=implicit-function-declaration",
    "-Werror=incompatible-pointer-types",
]

ROOTS = ("operator", "engine-image")
packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    for pkg in find_namespace_packages(root, include=["kvfence.*"]):
        packages.append(pkg)
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

ext_modules = [
    Extension(
        "kvfence.isolation._prefix_walk",
        ["engine-image/kvfence/isolation/_prefix_walk.c"],
        libraries=["crypto"],
        extra_compile_args=COMPILE_ARGS,
        define_macros=[LIMITED_API],
        py_limited_api=True,
        depends=["setup.py"],  # a change of flags rebuilds, not only a change of source
    ),
    Extension(
        "kvfence.vllm._records",
        ["engine-image/kvfence/vllm/_records.c"],
        extra_compile_args=COMPILE_ARGS,
        define_macros=[LIMITED_API],
        py_limited_api=True,
        depends=["setup.py"],  # a change of flags rebuilds, not only a change of source
    ),
]

setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=ext_modules,
    options={"bdist_wheel": {"py_limited_api": ABI3_TAG}},
)
