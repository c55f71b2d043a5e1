"""``kubectl elasticrun``: read and drive ElasticRuns with the user's own credentials.

The console script ``kubectl-elasticrun`` is a kubectl plugin (kubectl runs any
``kubectl-*`` on PATH).  It lives beside ``elasticrun.api`` because it needs
nothing more than the handler's dependencies (the official client for
credentials, PyYAML) and the shared model: it never imports the operator or
torch.  :mod:`.verbs` and :mod:`.screen` are pure (what each verb changes, what
the screen shows); :mod:`.main` is the thin layer that reads arguments, talks to
the API server and turns its failures into messages that say what to do.
"""
