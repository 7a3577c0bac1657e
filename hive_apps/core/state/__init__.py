"""The registry's pure state: model records with their reservations, the device ledger, the
book of models and its typed transitions, start locks. The registry's Serve shell
(control/registry/) owns one instance and stores it."""
