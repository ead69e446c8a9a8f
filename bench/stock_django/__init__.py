"""The baseline of bench_me.py: a stock Django deployment of the same `/me` view.

Django's own ASGI handler on daphne, DRF's stock token authentication, the middleware `startproject`
generates, a database connection per request (Django's default), SQLite in a scratch directory. Nothing
tuned: this is what Palisade's request path is compared with.
"""
