#!/bin/bash
# Solver variants x solver seeds x models on one GPU call (the older interface, models comma-separated):
#   P=8 TO=400 bash scripts/gpu16/var.sh "def NAME" "0 1 2" demo,model2
# is scripts/gpu16/zoo_var.sh "def NAME" "0 1 2" "demo model2" (which also takes zoo<S> models); see there.
exec bash "$(dirname "$0")/zoo_var.sh" "$1" "$2" "${3:-demo,model2}"
