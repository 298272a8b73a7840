"""Code generation: kernel specifications and their rendering from the Jinja2 templates."""
