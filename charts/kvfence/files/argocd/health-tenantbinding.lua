-- Argo CD health check of kvfence.dev/TenantBinding (resource.customizations.health.kvfence.dev_TenantBinding).
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
if c.Bound ~= nil and c.Bound.status == "True" and c.SpecAccepted ~= nil and c.SpecAccepted.status == "False" then
  -- an edit was refused: the tenant is served with its last accepted spec, the sync did not take
  return {status = "Degraded", message = say(c.SpecAccepted)}
end
if c.Bound ~= nil and c.Bound.status == "True" and c.Clamped ~= nil and c.Clamped.status == "True" then
  -- the class was edited under the spec in force: the tenant is served within the class's bounds
  return {status = "Degraded", message = say(c.Clamped)}
end
if c.Bound ~= nil and c.Bound.status == "True" then
  return {status = "Healthy", message = say(c.Bound)}
end
if c.Denied ~= nil and c.Denied.status == "True" then
  return {status = "Degraded", message = say(c.Denied)}
end
if c.Bound ~= nil then
  return {status = "Progressing", message = say(c.Bound)}
end
return hs
