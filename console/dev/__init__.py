"""``longcall dev``: the whole fleet on embedded services, and a demo that shows what longcall is for.

``services`` starts the embedded Postgres and Redis (from wheels: nothing to install), ``processes`` the
fleet's children and their teardown, ``demo`` the scenario, ``display`` what the terminal shows, and
``command`` the click command that ties them together.
"""
