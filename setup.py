"""kvfence is one distribution whose namespace package ``kvfence`` is spread over two source roots:
``operator/`` (API, operator, router) and ``engine-image/`` (contract, engine, vLLM plugin). setuptools'
declarative config cannot map one namespace onto two roots, so this file does that mapping, and
declares the compiled modules: the prefix cache's verified walk (``_prefix_walk.c``, linked against
OpenSSL's libcrypto) and the vLLM fence's prefix-cache records (``_records.c``). ``KVFENCE_PURE_PYTHON=1``
builds without them (a wheel for any Python, as the GPU vLLM image needs: its Python is vLLM's; the
fence then uses its pure-Python records, see kvfence.vllm.records); everything else lives in
pyproject.toml."""

import os

from setuptools import Extension, find_namespace_packages, setup

ROOTS = ("operator", "engine-image")
packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    for pkg in find_namespace_packages(root, include=["kvfence.*"]):
        packages.append(pkg)
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

ext_modules = []
if os.environ.get("KVFENCE_PURE_PYTHON") != "1":
    ext_modules.append(
        Extension(
            "kvfence.engine._prefix_walk",
            ["engine-image/kvfence/engine/_prefix_walk.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2"],
        )
    )
    ext_modules.append(
        Extension(
            "kvfence.vllm._records",
            ["engine-image/kvfence/vllm/_records.c"],
            extra_compile_args=["-O2"],
        )
    )

setup(packages=packages, package_dir=package_dir, ext_modules=ext_modules)
