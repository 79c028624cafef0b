"""The C extension only: everything else about the distribution is in pyproject.toml.

A ``setup.py`` because the pinned build requirements (setuptools>=69) cannot
declare ``ext_modules`` in pyproject.toml without an experimental table.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "xinfra._records",
            ["xinfra/_records.c"],
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
