"""Framework integrations: Flask, FastAPI and Alembic's autogenerate hooks."""
