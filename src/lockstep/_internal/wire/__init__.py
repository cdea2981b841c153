"""Between the driver and its ranks: the JSON messages, the authenticated channel that carries
them, lost-link detection, and the addresses ranks advertise.
"""
