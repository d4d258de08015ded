"""A Flask and Flask-SQLAlchemy shop that confirms orders in the background (see app.py)."""
