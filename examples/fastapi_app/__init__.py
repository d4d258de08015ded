"""A FastAPI shop on async SQLAlchemy that confirms orders in a worker of its own event loop (see app.py)."""
