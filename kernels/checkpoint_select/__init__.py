"""Rollback: select the recurrent and conv state recorded after the accepted step."""
