"""Built-in models the hive can build offline (the tiny chat model of the quickstart and tests)."""
