"""An example out-of-tree pagedlm platform (see the package's README.md).

Nothing here is imported by pagedlm until the registry loads the ``pagedlm`` entry point
(``plugin.py``), and the platform, backend and executor modules only when selected.
"""
