"""Alembic migrations of the Tandem catalog: the only way its schema is created or changed.

`env.py` migrates either over a connection handed in by `catalog.Catalog.open` (through
`config.attributes["connection"]`) or over an engine it makes from the URL given on the
command line (`alembic -x url=...`, see alembic.ini). Revisions live in `versions/`, named
by date; each has a docstring saying why, and both `upgrade` and `downgrade`.

This package imports `catalog` (for the models' metadata and the engine settings) and
nothing else of ours. It is loaded by Alembic, never imported by the catalog.
"""
