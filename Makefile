# The README's commands. Each installs what is missing first (infra/setup.sh), so a fresh machine
# needs nothing else.
SHELL := /bin/bash
VENV := .venv
PYTEST_ARGS ?=
RUN_CONFIG ?= configs/cpu.yaml
RUN_ARGS ?=

.PHONY: run test setup infra-up infra-down infra-status bench docker-context compose-test clean

## make run: set up, start the infrastructure, train one run (configs/cpu.yaml) and write its report, stop what was started
run: setup
	infra/with-infra.sh $(VENV)/bin/rollstream up --config $(RUN_CONFIG) $(RUN_ARGS)

## make test: set up, start the infrastructure, run every test, stop what was started
test: setup
	infra/with-infra.sh $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

setup:
	infra/setup.sh

infra-up: setup
	infra/up.sh

infra-down:
	infra/down.sh

infra-status:
	-@infra/kafka.sh status; infra/minio.sh status

## make bench: the platform benchmark (Kafka and MinIO against local baselines)
bench: setup
	infra/with-infra.sh $(VENV)/bin/rollstream bench bus

## make docker-context: the files the images copy that are not in the repository (.docker-context/)
docker-context:
	infra/compose/context.sh

## make compose-test: build every image on a debootstrap base in a private Docker engine and run docker-compose.yml
## end to end on configs/compose-test.yaml (infra/compose/test.py): not part of make test (it builds a 5 GB image)
compose-test: setup
	$(VENV)/bin/python infra/compose/test.py

clean: infra-down
	rm -rf .run
