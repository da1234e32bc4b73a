# train_mlp is several files (client/examples/mlp/): its link rule takes
# their objects, and so does the tests' fault-injecting launcher built on
# them (tests/integration/train_mlp_faults.c), which test_train,
# test_step_kill and test_step_pause run; test_train_checkpoint runs
# train_mlp.
TRAIN_MLP_OBJ    := $(call obj,$(wildcard client/examples/mlp/*.c))
TRAIN_MLP_FAULTS := $(BUILD)/tests/integration/train_mlp_faults

$(BUILD)/examples/train_mlp: $(BUILD)/client/examples/train_mlp.o $(TRAIN_MLP_OBJ) $(LIBCLIENT_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lpthread -lm $(CUDA_LDLIBS)

$(TRAIN_MLP_FAULTS): $(BUILD)/tests/integration/train_mlp_faults.o $(TRAIN_MLP_OBJ) $(LIBCLIENT_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lpthread -lm $(CUDA_LDLIBS)

# Built before the suite that runs it (order-only: not linked into it).
$(BUILD)/tests/integration/test_train: | $(TRAIN_MLP_FAULTS)
$(BUILD)/tests/integration/test_step_kill: | $(TRAIN_MLP_FAULTS) $(BUILD)/examples/train_mlp
$(BUILD)/tests/integration/test_step_pause: | $(TRAIN_MLP_FAULTS) $(BUILD)/examples/train_mlp
$(BUILD)/tests/integration/test_train_checkpoint: | $(BUILD)/examples/train_mlp
