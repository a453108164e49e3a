"""meshgin's gin configs, shipped with the package.

`--gin_file=configs/experiments/quickstart.gin` and the configs' own
`include 'configs/...'` lines find these files from any directory: through
the current directory first, then --gin_search_paths, then this package
(gin reads a `package/path/file.gin` from an importable package). The
`__init__.py` files make each directory such a package; they hold no code.
"""
