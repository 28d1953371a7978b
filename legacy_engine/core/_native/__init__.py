"""The only package that touches the cffi `lib` and `ffi` of the C core (legacy_engine._core).

Every wrapper is the same: borrow buffers (ffi.from_buffer), call, check the status, raise. Shapes and dtypes are
given in the docstrings. One module per area of the C API, each taking `lib`/`ffi` from _lib (which loads them):
  detect      CPU features, NUMA nodes, GPUs          quants      type traits, (de)quantising a row
  model       le_model, le_state, the forward pass    isa         kernel tiers, gdn_step and the dot products
  gpu_driver  the CUDA driver API (le_gpu.h)          memory      anonymous memory, madvise, NUMA policies
  sampler     le_sample (penalties, top-k/p, min-p, the draw)     schema      the tensor schema table (le_schema.h)
`from legacy_engine.core import _native; _native.X` names every wrapper, whichever module holds it.
"""
# re-exported: _native.X is the engine's one view of the C API
from ..errors import NativeError, UnavailableError  # noqa: F401
from ._lib import INT_MAX, LE_OK, c_int, check, ffi, lib, struct_to_dict  # noqa: F401
from .detect import cpu_info, gpu_info, numa_info  # noqa: F401
from .gpu_driver import (  # noqa: F401
    gpu_alloc, gpu_attribute, gpu_capture, gpu_copy_dtod, gpu_copy_dtoh, gpu_copy_htod, gpu_copy_htod_addr,
    gpu_current_device, gpu_event_create, gpu_event_destroy, gpu_event_elapsed_ms, gpu_event_record,
    gpu_event_synchronize, gpu_free, gpu_graph_destroy, gpu_graph_launch, gpu_graphs_available, gpu_host_alloc,
    gpu_host_device_pointer, gpu_host_free, gpu_host_register, gpu_host_unregister, gpu_init, gpu_kernel_get,
    gpu_kernel_info, gpu_launch, gpu_launch_args, gpu_mem_stats, gpu_memset8, gpu_module_load, gpu_module_log,
    gpu_module_unload, gpu_replay, gpu_set_budget, gpu_shutdown, gpu_stream_create, gpu_stream_destroy,
    gpu_stream_query, gpu_stream_synchronize, gpu_stream_wait_event, gpu_synchronize, host_address)
from .isa import (ISA_NAMES, dot_f32, exp_sub_sum_f32, f32_isa, fp_flushes, gdn_step, gelu_tanh_f32,  # noqa: F401
                  gemm_f32, gemm_nn_f32, get_isa, has_vec_dot_n, isa_supported, kernel_isa, quantize_act, set_isa,
                  silu_f32, vec_dot, vec_dot_n, vec_dot_rows)
from .memory import (MPOL_NAMES, NUMA_MODES, AnonMemory, mem_advise, mem_alloc, mem_page_nodes,  # noqa: F401
                     mem_policy, mem_prefault, mem_set_numa, numa_cpus_of_node, numa_nodes, numa_set_library,
                     numa_spread_cpus, numa_thread_policy, numa_thread_policy_set)
from .model import PROFILE_PHASES, NativeModel, NativeState, fault_bits, forward, forward_seqs  # noqa: F401
from .quants import dequantize_row, quantize_row, type_traits  # noqa: F401
from .schema import (HPARAM_FIELDS, MAX_LAYERS, hparams_struct, layer_kinds, schema_arch_names,  # noqa: F401
                     schema_dims, schema_rows)
from .vision import (VISION_FAULTS, VISION_ROLES, NativeVision, vision_attention,  # noqa: F401
                     vision_fault_bits, vision_gelu, vision_layernorm, vision_pos_embed, vision_rope, vision_slot)
from .sampler import SAMPLE_FORCE, SAMPLE_PATHS, NativeSampler, sample_isa  # noqa: F401
