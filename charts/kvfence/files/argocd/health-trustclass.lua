-- Argo CD health check of kvfence.dev/TrustClass (resource.customizations.health.kvfence.dev_TrustClass).
-- Reads the conditions the kvfence operator writes; see docs/helm.md, "GitOps".
local hs = {status = "Progressing", message = "waiting for the kvfence operator"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= obj.metadata.generation then
  hs.message = "the kvfence operator has not observed this generation yet"
  return hs
end
local c = {}
for _, cond in ipairs(obj.status.conditions) do
  c[cond.type] = cond
end
local function say(cond)
  if cond.message ~= nil and cond.message ~= "" then
    return cond.reason .. ": " .. cond.message
  end
  return cond.reason
end
if c.Stalled ~= nil and c.Stalled.status == "True" then
  return {status = "Degraded", message = say(c.Stalled)}
end
if c.Ready ~= nil and c.Ready.status == "True" then
  return {status = "Healthy", message = say(c.Ready)}
end
if c.Ready ~= nil and c.Ready.reason == "ScaledToZero" then
  return {status = "Suspended", message = say(c.Ready)}
end
if c.Reconciling ~= nil and c.Reconciling.status == "True" then
  return {status = "Progressing", message = say(c.Reconciling)}
end
if c.Ready ~= nil then
  return {status = "Degraded", message = say(c.Ready)}
end
return hs
