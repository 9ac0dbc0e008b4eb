# The front door (its library, and the hetero-front binary) links no prefill engine, no GPU code
# and not the prefill host: the decode side meets them only over the wire. Checked on the link
# graph at configure time, so a wrong dependency fails the build (scripts/check_layers.py checks
# the includes, and the binary's symbols).
function(hetero_link_closure target out)
  set(seen "")
  set(todo ${target})
  while(todo)
    list(POP_FRONT todo t)
    if(t IN_LIST seen OR NOT TARGET ${t})
      continue()
    endif()
    list(APPEND seen ${t})
    get_target_property(libs ${t} LINK_LIBRARIES)
    get_target_property(ilibs ${t} INTERFACE_LINK_LIBRARIES)
    foreach(l IN LISTS libs ilibs)
      string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" l "${l}")
      if(l AND TARGET ${l})
        list(APPEND todo ${l})
      endif()
    endforeach()
  endwhile()
  set(${out} ${seen} PARENT_SCOPE)
endfunction()

foreach(front hetero_front hetero-front)
  hetero_link_closure(${front} front_closure)
  foreach(forbidden hetero_engine hetero_prefill hetero_cuda hetero_engine_cuda hetero_bridge_cuda)
    if(forbidden IN_LIST front_closure)
      message(FATAL_ERROR "${front} links ${forbidden} (through: ${front_closure}); the front "
                          "door must not link a prefill engine or the prefill host")
    endif()
  endforeach()
endforeach()
