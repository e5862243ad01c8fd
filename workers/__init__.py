"""Celery workers for Context Tracker: ``workers.app`` (the app) and ``workers.tasks`` (the count task)."""
