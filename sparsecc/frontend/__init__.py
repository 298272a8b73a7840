"""From a user's model to graphs: tracing (the graph rewrites are the top-level ``passes/``,
installed as ``sparsecc.passes``)."""
