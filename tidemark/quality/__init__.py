"""Great Expectations, and only that: parsing expectation specs into GX classes, row-level
checks, batch gates, and the Data Docs site.

May import: core.
"""
