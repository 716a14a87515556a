"""The coordinator's web dashboard: a page at ``/`` that reads the ``/v1`` API from the
browser (see ``routes.py``); its HTML, JavaScript and CSS are package data in ``static/``."""
