"""kvfence is one distribution whose namespace package ``kvfence`` is spread over two source roots:
``operator/`` (API, operator, router) and ``engine-image/`` (contract, engine, vLLM plugin). setuptools'
declarative config cannot map one namespace onto two roots, so this file does only that mapping;
everything else lives in pyproject.toml."""

from setuptools import find_namespace_packages, setup

ROOTS = ("operator", "engine-image")
packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    for pkg in find_namespace_packages(root, include=["kvfence.*"]):
        packages.append(pkg)
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
