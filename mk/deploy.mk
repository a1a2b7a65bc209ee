# `make deploy`: a local Prefect server (unless one is configured), a process work pool and worker,
# and the deployments of prefect.yaml. `make stop`: stop what deploy started (pid files in .prefect/).
# Server and worker run in their own sessions (setsid), so stop signals their whole process groups.
#
# A server is "configured" when PREFECT_API_URL is set in the environment or a prefect.toml exists
# here; otherwise deploy starts one on 127.0.0.1:$(SAILOR_PREFECT_PORT) and writes prefect.toml with
# its api.url, so every `prefect ...` run from this folder (e.g. `prefect deployment run sailor/train
# --watch`) talks to it. `make stop` removes that prefect.toml again (the demo then runs ephemeral).

SAILOR_PREFECT_PORT ?= 4200
SAILOR_POOL         ?= sailor-local
DEPLOY_DIR          := $(CURDIR)/.prefect
DEPLOY_TOML_MARK    := $(DEPLOY_DIR)/prefect.toml.ours

.PHONY: deploy stop

deploy: $(STAMP)
	@mkdir -p $(DEPLOY_DIR)
	@set -e; \
	if [ -n "$$PREFECT_API_URL" ]; then \
	  api="$$PREFECT_API_URL"; echo "using the configured Prefect server $$api"; \
	elif [ -f prefect.toml ] && [ ! -f $(DEPLOY_TOML_MARK) ]; then \
	  api=$$(sed -n 's/^url *= *"\(.*\)"/\1/p' prefect.toml | head -1); echo "using the server of prefect.toml: $$api"; \
	else \
	  api="http://127.0.0.1:$(SAILOR_PREFECT_PORT)/api"; \
	  if [ -f $(DEPLOY_DIR)/server.pid ] && kill -0 $$(cat $(DEPLOY_DIR)/server.pid) 2>/dev/null; then \
	    echo "Prefect server already running (pid $$(cat $(DEPLOY_DIR)/server.pid))"; \
	  else \
	    echo "starting a Prefect server on 127.0.0.1:$(SAILOR_PREFECT_PORT) (log: .prefect/server.log)"; \
	    PREFECT_API_URL= PREFECT_UI_API_URL="$$api" PREFECT_SERVER_API_PORT=$(SAILOR_PREFECT_PORT) setsid nohup $(BIN)/prefect server start --host 127.0.0.1 --port $(SAILOR_PREFECT_PORT) \
	      > $(DEPLOY_DIR)/server.log 2>&1 & echo $$! > $(DEPLOY_DIR)/server.pid; \
	  fi; \
	  printf '# written by make deploy; removed by make stop\n[api]\nurl = "%s"\n' "$$api" > prefect.toml; \
	  touch $(DEPLOY_TOML_MARK); \
	  for i in $$(seq 1 120); do \
	    if $(BIN)/python -c "import urllib.request,sys; urllib.request.urlopen('$$api/health', timeout=2)" 2>/dev/null; then break; fi; \
	    if ! kill -0 $$(cat $(DEPLOY_DIR)/server.pid) 2>/dev/null; then echo "the Prefect server died; see .prefect/server.log"; exit 1; fi; \
	    sleep 1; \
	  done; \
	fi; \
	export PREFECT_API_URL="$$api"; \
	$(BIN)/prefect --no-prompt work-pool create $(SAILOR_POOL) --type process >/dev/null 2>&1 || true; \
	if [ -f $(DEPLOY_DIR)/worker.pid ] && kill -0 $$(cat $(DEPLOY_DIR)/worker.pid) 2>/dev/null; then \
	  echo "worker already running (pid $$(cat $(DEPLOY_DIR)/worker.pid))"; \
	else \
	  echo "starting a process worker on pool $(SAILOR_POOL) (log: .prefect/worker.log)"; \
	  PREFECT_WORKER_QUERY_SECONDS=2 setsid nohup $(BIN)/prefect worker start --pool $(SAILOR_POOL) \
	    > $(DEPLOY_DIR)/worker.log 2>&1 & echo $$! > $(DEPLOY_DIR)/worker.pid; \
	fi; \
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/prefect --no-prompt deploy --all; \
	echo "deployed. Run it: $(BIN)/prefect deployment run sailor/train --watch   (UI: $${api%/api})"

stop:
	@for p in worker server; do \
	  f=$(DEPLOY_DIR)/$$p.pid; \
	  if [ -f $$f ]; then \
	    pid=$$(cat $$f); \
	    if kill -0 $$pid 2>/dev/null; then \
	      echo "stopping the Prefect $$p (pid $$pid)"; kill -TERM -- -$$pid 2>/dev/null || kill -TERM $$pid; \
	      for i in $$(seq 1 30); do kill -0 $$pid 2>/dev/null || break; sleep 0.5; done; \
	      kill -0 $$pid 2>/dev/null && { kill -KILL -- -$$pid 2>/dev/null || kill -KILL $$pid; }; \
	    fi; \
	    rm -f $$f; \
	  fi; \
	done; \
	if [ -f $(DEPLOY_TOML_MARK) ]; then rm -f prefect.toml $(DEPLOY_TOML_MARK); fi; \
	echo "stopped"
